// Checks the CUDA kernel's work split and shared-memory placement on the CPU (no GPU needed).
//
// Usage: host_check TILES NUM_BLOCKS RUN CTAS... Each CTA count is checked with the kernels' own
// helpers (Split with runs of RUN blocks: kWarps for the GEMV, 2 for its 16-token pairs, 1 for
// the wgmma GEMM; segment_at, Segment::block, word_offset from gptq_gemv.cuh):
// - every item (column tile, 128-row block) is taken by exactly one warp of exactly one CTA;
// - a tile is written directly by a CTA only when that CTA owns all of it; otherwise its
//   contributors are exactly the CTAs Split::contributors names, the tile is the last segment of
//   the first of them (which finishes it) and the first segment of each other one (which writes its
//   partial sums to workspace slot cta);
// - no CTA writes two partial tiles (so slot cta is enough: the workspace has ctas slots);
// - every segment is whole runs (only a tile's last run may be short);
// - each 8-lane phase of a warp's 16-byte ring reads hits 8 distinct 16-byte bank groups.
// Prints "ok" and exits 0, or names the first violation and exits 1.
//
// `host_check grid TILES BLOCKS RESIDENT` prints the wgmma GEMM's grid (gemm_grid in
// gptq_gemm.cuh) as "CTAS SPLIT", after checking that each CTA of an exact split works in its
// own tile only.
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "gptq_gemm.cuh"  // and gptq_gemv.cuh

namespace {

using pagedq::gptq::kBlockK;
using pagedq::gptq::kTileN;
using pagedq::gptq::kWarps;
using pagedq::gptq::Params;
using pagedq::gptq::Segment;
using pagedq::gptq::segment_at;
using pagedq::gptq::Split;
using pagedq::gptq::word_offset;

int fail(const char* what, long a, long b, long c) {
  std::printf("FAIL: %s (%ld, %ld, %ld)\n", what, a, b, c);
  return 1;
}

// kSlices: the CTA's K-slices (kWarps; 2 for the GEMV's 16-token pairs, whose runs are 2 blocks).
template <int kSlices>
int check_split(int tiles, int num_blocks, int run, int ctas) {
  Params p{};
  p.tiles = tiles;
  p.num_blocks = num_blocks;
  p.N = tiles * kTileN;
  p.K = num_blocks * kBlockK;
  const int64_t items = static_cast<int64_t>(tiles) * num_blocks;
  const Split split(tiles, num_blocks, run, ctas);
  if (ctas > split.runs) return fail("more CTAs than runs", ctas, split.runs, 0);
  std::vector<int> taken(items, 0);
  std::vector<std::vector<int>> sharing(tiles);  // CTAs flushing a partial of the tile
  std::vector<int> direct(tiles, 0);
  std::set<int> slots;  // CTAs that wrote their workspace slot
  for (int c = 0; c < ctas; ++c) {
    const int64_t begin = split.begin(c), end = split.end(c);
    if (begin >= end) return fail("empty CTA", c, begin, end);
    for (int64_t item = begin; item < end;) {
      const Segment<kSlices> s0 = segment_at<kSlices>(p, item, end, 0);
      if (s0.b0 % run != 0 || (s0.b1 % run != 0 && s0.b1 != num_blocks)) {
        return fail("a segment not made of whole runs", c, s0.b0, s0.b1);
      }
      for (int w = 0; w < kSlices; ++w) {
        const Segment<kSlices> s = segment_at<kSlices>(p, item, end, w);
        for (int i = 0; i < s.count; ++i) {
          const int b = s.block(i);
          if (b < s.b0 || b >= s.b1) return fail("block outside its segment", c, w, b);
          taken[static_cast<int64_t>(s.tile) * num_blocks + b] += 1;
        }
      }
      if (s0.b0 == 0 && s0.b1 == num_blocks) {
        direct[s0.tile] += 1;
      } else {
        const bool starts_tile = s0.b0 == 0, first_seg = item == begin;
        const bool last_seg = item + (s0.b1 - s0.b0) == end;
        if (starts_tile ? !last_seg : !first_seg) {  // the kernel's shared / owned roles
          return fail("split tile in an unexpected segment", c, s0.tile, s0.b0);
        }
        sharing[s0.tile].push_back(c);
        if (!starts_tile && !slots.insert(c).second) {
          return fail("a CTA writes two partial tiles", s0.tile, c, 0);
        }
      }
      item += s0.b1 - s0.b0;
    }
  }
  for (int64_t i = 0; i < items; ++i) {
    if (taken[i] != 1) {
      return fail("item not taken exactly once", i / num_blocks, i % num_blocks, taken[i]);
    }
  }
  for (int t = 0; t < tiles; ++t) {
    int first, last;
    split.contributors(t, first, last);
    if (direct[t] == 1 && sharing[t].empty() && first == last) continue;
    if (direct[t] != 0) return fail("tile both written directly and split", t, direct[t], 0);
    const int count = static_cast<int>(sharing[t].size());
    if (count < 2 || count != last - first + 1) {
      return fail("contributor count", t, count, last - first + 1);
    }
    for (int k = 0; k < count; ++k) {
      if (sharing[t][k] != first + k) {
        return fail("sharing CTAs not contributors()' range", t, k, sharing[t][k]);
      }
    }
  }
  return 0;
}

int check_banks() {
  // lane (g, t) reads word_offset(4t + j) + 16 g + 128 h; lanes 8q..8q+7 share a phase
  for (int j = 0; j < 4; ++j) {
    for (int h = 0; h < 2; ++h) {
      for (int phase = 0; phase < 4; ++phase) {
        std::set<int> groups;
        for (int lane = 8 * phase; lane < 8 * phase + 8; ++lane) {
          const int g = lane / 4, t = lane % 4;
          groups.insert((word_offset(4 * t + j) + 16 * g + 128 * h) % 128 / 16);
        }
        if (groups.size() != 8) return fail("bank conflict in a ring read", j, h, phase);
      }
    }
  }
  for (int r = 0; r + 1 < 16; ++r) {
    if (word_offset(r + 1) - word_offset(r) < 256 || word_offset(r) % 16 != 0) {
      return fail("word rows overlap or are misaligned", r, word_offset(r), word_offset(r + 1));
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "grid") {  // the wgmma GEMM's grid: "CTAS SPLIT"
    int split = 0;
    const int64_t tiles = std::atoll(argv[2]);
    const int num_blocks = std::atoi(argv[3]);
    const int ctas = pagedq::gptq::gemm_grid(tiles, num_blocks, std::atoi(argv[4]), split);
    const Split work(static_cast<int>(tiles), num_blocks, 1, ctas);  // the kernel's split
    for (int c = 0; c < ctas && split > 0; ++c) {  // an exact split: CTA c holds part of tile c / k
      const int64_t begin = work.begin(c), end = work.end(c);
      if (begin >= end || begin / num_blocks != c / split || (end - 1) / num_blocks != c / split) {
        return fail("exact split: a CTA outside its tile", c, begin, end);
      }
    }
    std::printf("%d %d\n", ctas, split);
    return 0;
  }
  if (argc < 5) {
    std::printf("usage: host_check TILES NUM_BLOCKS RUN CTAS...\n"
                "       host_check grid TILES BLOCKS RESIDENT\n");
    return 2;
  }
  const int tiles = std::atoi(argv[1]), num_blocks = std::atoi(argv[2]), run = std::atoi(argv[3]);
  if (check_banks() != 0) return 1;
  for (int a = 4; a < argc; ++a) {
    const int ctas = std::atoi(argv[a]);
    const int bad = run == 2 ? check_split<2>(tiles, num_blocks, run, ctas)
                             : check_split<kWarps>(tiles, num_blocks, run, ctas);
    if (bad != 0) return 1;
  }
  std::printf("ok\n");
  return 0;
}

"""Tokenizers, chat templates and streaming detokenization against transformers.

Three small folders are built in the test session: a byte-level BPE `tokenizer.json`
(ChatML template), a sentencepiece `tokenizer.model` trained here (Llama-2-style template),
and the `tokenizer.json` transformers saves for that sentencepiece model.
"""

from __future__ import annotations

import io
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from pagedq.errors import InvalidRequestError, TokenizerError
from pagedq.loader.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = """The quick brown fox jumps over the lazy dog. Pack my box with five dozen jugs.
Héllo wörld, ça va? Grüße aus Köln. Ünïcödé is fun: naïve café résumé.
def main(argv):
    for i in range(10):
        print(i * 2, "hello")  # a comment
    return {"key": [1, 2, 3]}
Numbers like 12345, 3.14159 and 2024-01-01 appear often; so do $5 and 50%.
東京は日本の首都です。 Москва — столица России. Ελληνικά γράμματα.
Emoji are fun 😀🎉 and so are symbols like ☃ → ∑ ≠ ∞.
Tabs\tand  double  spaces   and
newlines.
"""

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "  two leading spaces",
    "trailing spaces   ",
    "Héllo wörld, ça va? 東京 and Москва",
    "Emoji: 😀🎉🧑‍🚀 and ☃ ∑",
    "def f(x):\n    return x ** 2  # square\n",
    "Numbers 1234567890 and 3.14159, 42%",
    "whitespace\t\ttabs\n\n\nnewlines    runs",
    "",
    " ",
    "never seen: ʤ ʧ ǂ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama-2 chat layout: optional system block folded into the first user turn, roles must
# alternate (raise_exception otherwise), every user turn opens with bos_token.
LLAMA2_TEMPLATE = """{% if messages[0]['role'] == 'system' %}
{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}
{% else %}{% set system = none %}{% set turns = messages %}{% endif %}
{% for m in turns %}
{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('roles must alternate user/assistant') }}
{% endif %}
{% if m['role'] == 'user' %}
{% if loop.first and system is not none %}
{% set text = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + m['content'] %}
{% else %}{% set text = m['content'] %}{% endif %}
{{ bos_token + '[INST] ' + text.strip() + ' [/INST]' }}
{% else %}{{ ' ' + m['content'].strip() + ' ' + eos_token }}{% endif %}
{% endfor %}"""

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Name a colour 🎨"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, s'il vous plaît?"},
    ],
]


def hf_ids(value: Any) -> list[int]:
    """transformers 5 returns a BatchEncoding where 4.x returned a list."""
    return list(value["input_ids"] if not isinstance(value, list) else value)


# --- folders -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte-level BPE trained here, with ChatML special tokens and template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    folder = tmp_path_factory.mktemp("bpe")
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(CORPUS.splitlines() * 20, trainer)
    tk.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True, "__type": "AddedToken"},
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return folder


def train_sentencepiece() -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines() * 30),
        model_writer=model,
        vocab_size=420,
        model_type="bpe",
        byte_fallback=True,  # as Llama: unseen characters become <0xNN> pieces
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        character_coverage=1.0,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return model.getvalue()


LLAMA_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "add_bos_token": True,
    "add_eos_token": False,
    "legacy": False,
    "chat_template": LLAMA2_TEMPLATE,
}


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sp")
    (folder / "tokenizer.model").write_bytes(train_sentencepiece())
    (folder / "tokenizer_config.json").write_text(json.dumps(LLAMA_CONFIG))
    return folder


def sp_reference(folder: Path) -> Any:
    """transformers' tokenizer for a sentencepiece folder.

    AutoTokenizer reads tokenizer.model only with protobuf installed; without it, build the same
    LlamaTokenizer from the vocabulary, as transformers' SentencePieceExtractor does.
    """
    try:
        import google.protobuf  # noqa: F401
    except ImportError:
        import sentencepiece as spm
        from transformers.tokenization_utils_base import generate_merges

        sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
        kwargs = {k: v for k, v in LLAMA_CONFIG.items() if k != "tokenizer_class"}
        return transformers.LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab), **kwargs)
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def llama_json_dir(sp_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer.json folder transformers writes for the sentencepiece model."""
    folder = tmp_path_factory.mktemp("llama_json")
    sp_reference(sp_dir).save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(chat_template=LLAMA2_TEMPLATE, add_bos_token=True, add_eos_token=False)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def reference(folder: Path) -> Any:
    if not (folder / "tokenizer.json").is_file():
        return sp_reference(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


FOLDERS = ["bpe_dir", "sp_dir", "llama_json_dir"]


@pytest.fixture(params=FOLDERS)
def folder(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(request.param))


def texts_with_specials(ref: Any) -> list[str]:
    bos = ref.bos_token or ""
    eos = ref.eos_token or ""
    return [*TEXTS, f"{bos}Hi there", f"one {eos} two{eos}", f"a{bos}{bos} b {eos}"]


# --- encode / decode ---------------------------------------------------------------------


def test_ids_match_transformers(folder: Path) -> None:
    ours, ref = Tokenizer.from_model_dir(folder), reference(folder)
    for text in texts_with_specials(ref):
        for add in (True, False):
            assert ours.encode(text, add) == ref.encode(text, add_special_tokens=add), (text, add)


def test_decode_matches_transformers(folder: Path) -> None:
    ours, ref = Tokenizer.from_model_dir(folder), reference(folder)
    for text in texts_with_specials(ref):
        ids = ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), text


def test_special_tokens_and_vocab(folder: Path) -> None:
    ours, ref = Tokenizer.from_model_dir(folder), reference(folder)
    assert ours.vocab_size == len(ref)
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_ids[0] == ref.eos_token_id
    assert set(ref.all_special_ids) <= ours.special_token_ids
    assert ours.id_to_token(ref.eos_token_id) == ref.eos_token


def test_generation_config_eos_ids_are_merged(bpe_dir: Path) -> None:
    tok = Tokenizer.from_model_dir(bpe_dir)
    assert tok.eos_token_ids == (2, 0)  # eos_token first, then the rest of generation_config
    assert tok.pad_token_id == 0


def test_tokenizer_json_post_processor_decides(bpe_dir: Path, tmp_path: Path) -> None:
    """With a tokenizer.json, add_bos_token / add_eos_token are ignored (as transformers 5)."""
    (tmp_path / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    config.update(add_bos_token=True, add_eos_token=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_model_dir(tmp_path)
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello") == Tokenizer.from_model_dir(bpe_dir).encode("hello")


def test_sentencepiece_flags(sp_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    config = {**LLAMA_CONFIG, "add_bos_token": False, "add_eos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok, plain = Tokenizer.from_model_dir(tmp_path), Tokenizer.from_model_dir(sp_dir)
    text = "hello world"
    assert tok.encode(text) == [*plain.encode(text, add_special_tokens=False), 2]
    assert plain.encode(text) == [1, *plain.encode(text, add_special_tokens=False)]


def test_missing_tokenizer_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json and tokenizer\.model") as info:
        Tokenizer.from_model_dir(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_corrupt_files(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_model_dir(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match=r"tokenizer\.model"):
        Tokenizer.from_model_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{bad")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json"):
        Tokenizer.from_model_dir(tmp_path)


# --- chat templates --------------------------------------------------------------------------


@pytest.mark.parametrize("folder_name", ["bpe_dir", "llama_json_dir"])
def test_chat_template_matches_transformers(
    folder_name: str, request: pytest.FixtureRequest
) -> None:
    folder = Path(request.getfixturevalue(folder_name))
    ours, ref = Tokenizer.from_model_dir(folder), reference(folder)
    assert ours.has_chat_template
    for conv in CONVERSATIONS:
        for gen in (True, False):
            text = ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert ours.render_chat(conv, add_generation_prompt=gen) == text
            ids = hf_ids(ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True))
            assert ours.apply_chat_template(conv, add_generation_prompt=gen) == ids


def test_llama2_template_uses_bos_token(llama_json_dir: Path) -> None:
    tok = Tokenizer.from_model_dir(llama_json_dir)
    ids = tok.apply_chat_template(CONVERSATIONS[1])
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 2
    assert tok.eos_token_ids[0] in ids


def test_raise_exception_becomes_tokenizer_error(llama_json_dir: Path) -> None:
    tok = Tokenizer.from_model_dir(llama_json_dir)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TokenizerError, match="roles must alternate"):
        tok.apply_chat_template(bad)


def with_template(base: Path, tmp_path: Path, template: Any, jinja_file: str | None = None) -> Path:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja_file)
    return tmp_path


def test_sandbox_blocks_python_internals(bpe_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_model_dir(with_template(bpe_dir, tmp_path, "{{ ''.__class__.__mro__ }}"))
    with pytest.raises(TokenizerError, match="unsafe"):
        tok.render_chat(CONVERSATIONS[0])


def test_sandbox_blocks_mutation(bpe_dir: Path, tmp_path: Path) -> None:
    template = "{{ messages.append({'role': 'x', 'content': 'y'}) }}"
    tok = Tokenizer.from_model_dir(with_template(bpe_dir, tmp_path, template))
    messages = [dict(m) for m in CONVERSATIONS[0]]
    with pytest.raises(TokenizerError):
        tok.render_chat(messages)
    assert messages == CONVERSATIONS[0]


def test_template_syntax_error(bpe_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_model_dir(with_template(bpe_dir, tmp_path, "{% for m in messages %}"))
    assert tok.encode("still usable for plain prompts")
    with pytest.raises(TokenizerError, match="does not compile"):
        tok.render_chat(CONVERSATIONS[0])


def test_no_template(bpe_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_model_dir(with_template(bpe_dir, tmp_path, None))
    assert not tok.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template(CONVERSATIONS[0])


def test_named_templates_and_jinja_file(bpe_dir: Path, tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEF"}]
    assert (
        Tokenizer.from_model_dir(with_template(bpe_dir, tmp_path, named)).render_chat([]) == "DEF"
    )
    jinja_dir = with_template(bpe_dir, tmp_path / "j", "CONFIG", jinja_file="{{ bos_token }}J")
    assert Tokenizer.from_model_dir(jinja_dir).render_chat([]) == "<|im_start|>J"  # file wins


def test_template_helpers(bpe_dir: Path, tmp_path: Path) -> None:
    template = "{{ strftime_now('%Y') | length }} {{ {'é': 1} | tojson }}"
    tok = Tokenizer.from_model_dir(with_template(bpe_dir, tmp_path, template))
    assert tok.render_chat([]) == '4 {"é": 1}'


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "list"),
        ([{"role": "user"}], r"messages\[0\]"),
        ([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}], r"messages\[1\]"),
        ([{"role": "user", "content": None}], r"messages\[0\]"),
        (["user: hi"], r"messages\[0\]"),
    ],
)
def test_bad_messages(bpe_dir: Path, messages: Any, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        Tokenizer.from_model_dir(bpe_dir).apply_chat_template(messages)


# --- streaming ---------------------------------------------------------------------------


def check_stream(tok: Tokenizer, ids: list[int], skip: bool) -> None:
    """The streamed text is the full decode at every step where that does not end in U+FFFD
    (an unfinished UTF-8 character, held back), and after flush()."""
    detok = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens=skip)
    pieces = []
    for step, token in enumerate(ids, start=1):
        pieces.append(detok.add(token))
        full = tok.decode(ids[:step], skip)
        assert detok.text == "".join(pieces)
        assert detok.text == full or full.endswith("\ufffd"), (ids[:step], detok.text, full)
    detok.flush()
    assert detok.text == tok.decode(ids, skip)


def test_incremental_detokenizer_on_texts(folder: Path) -> None:
    tok = Tokenizer.from_model_dir(folder)
    for text in texts_with_specials(reference(folder)):
        ids = tok.encode(text)
        for skip in (True, False):
            check_stream(tok, ids, skip)


def test_multibyte_characters_are_held_back(folder: Path) -> None:
    tok = Tokenizer.from_model_dir(folder)
    ids = tok.encode("𝔘 ok", add_special_tokens=False)  # 4 UTF-8 bytes, unseen in training
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add(i) for i in ids]
    assert "\ufffd" not in "".join(deltas)
    assert detok.text == "𝔘 ok" and deltas[0] == ""


def test_incremental_detokenizer_on_random_ids(folder: Path) -> None:
    tok = Tokenizer.from_model_dir(folder)
    rng = random.Random(0)
    specials = sorted(tok.special_token_ids)
    # Byte-fallback pieces (<0xNN>) are left out: a run of them that is not valid UTF-8 decodes
    # to one U+FFFD per byte, so a valid character streamed before an invalid byte of the same
    # run cannot be taken back. Byte-level BPE (bpe_dir) has no such pieces and keeps all ids.
    usable = [
        i
        for i in range(tok.vocab_size)
        if not re.fullmatch(r"<0x[0-9A-F]{2}>", tok.id_to_token(i) or "")
    ]
    for _ in range(20):
        ids = [rng.choice(usable) for _ in range(40)]
        ids[rng.randrange(40)] = rng.choice(specials)
        for skip in (True, False):
            check_stream(tok, ids, skip)


def test_detokenizer_keeps_prompt_ids(bpe_dir: Path) -> None:
    detok = IncrementalDetokenizer(Tokenizer.from_model_dir(bpe_dir), [5, 6, 7])
    assert detok.prompt_token_ids == (5, 6, 7) and detok.text == ""

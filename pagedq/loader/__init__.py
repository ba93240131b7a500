"""Model folders: config.json (`hf_config`), safetensors weights (`weights`), tokenizers and
chat templates (`tokenizer`), GGUF conversion (`gguf_convert`) and the embedded default model
(`default_model`). Nothing is imported here, so `import pagedq.loader` stays cheap."""

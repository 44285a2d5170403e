#!/usr/bin/env python3
"""Writes two small byte-level BPE tokenizer.json files for the HF tokenizer tests (from the first
merges of GPT-2's vocabulary in data/gpt2, see tools/fetch_demo_data.sh) and the texts to encode:
  tests/data/fixtures/hf_ref/gpt2style.tokenizer.json   ByteLevel pre-tokenizer (GPT-2 regex), "a b" merges
  tests/data/fixtures/hf_ref/llama3style.tokenizer.json Split(Llama-3 regex) + ByteLevel(use_regex=false),
                                                        ["a","b"] merges, ignore_merges, BOS template
  tests/data/fixtures/hf_ref/texts.json
The reference ids are then computed with the Hugging Face `tokenizers` library (Rust, through its
node binding) by tools/megatron_ref/hf_ref.js."""
import json, os, sys

N_MERGES = 1200
root = sys.argv[1] if len(sys.argv) > 1 else "."
enc = json.load(open(os.path.join(root, "data/gpt2/encoder.json")))
merges = [l.split(" ") for l in open(os.path.join(root, "data/gpt2/vocab.bpe"), encoding="utf-8").read().split("\n")[1:] if l]
merges = merges[:N_MERGES]
inv = sorted(enc.items(), key=lambda kv: kv[1])
vocab = {tok: i for tok, i in inv[:256]}
for a, b in merges:
    if a + b not in vocab:
        vocab[a + b] = len(vocab)
out = os.path.join(root, "tests/data/fixtures/hf_ref")
os.makedirs(out, exist_ok=True)
eot = len(vocab)
gpt2 = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [{"id": eot, "content": "<|endoftext|>", "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": True, "special": True}],
    "normalizer": None,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
              "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
              "vocab": vocab, "merges": [a + " " + b for a, b in merges]},
}
json.dump(gpt2, open(os.path.join(out, "gpt2style.tokenizer.json"), "w"), ensure_ascii=False)
pat = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
bos, eos, pad = eot, eot + 1, eot + 2
llama = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [
        {"id": bos, "content": "<|begin_of_text|>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True},
        {"id": eos, "content": "<|end_of_text|>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True},
        {"id": pad, "content": "<|pad|>", "single_word": False, "lstrip": True, "rstrip": True, "normalized": False, "special": True}],
    "normalizer": None,
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pat}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
    "post_processor": {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos], "tokens": ["<|begin_of_text|>"]}}}]},
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
              "vocab": vocab, "merges": [[a, b] for a, b in merges]},
}
json.dump(llama, open(os.path.join(out, "llama3style.tokenizer.json"), "w"), ensure_ascii=False)
texts = [
    "Hello world", " Hello", "Hello world's 12345 numbers 1234567 and 3.14159!", "I'LL do it, he'S here; they'Re 'll",
    "   leading spaces", "trailing spaces   ", "tabs\tand\nnewlines\r\n\r\nmore\n\n\n  x", "a  b   c    d",
    "<|endoftext|>text<|endoftext|> and <|begin_of_text|>x<|end_of_text|> y <|pad|> z  <|pad|>",
    "Ünïcödé café naïve — “quotes” ‘single’ … €100 ¥200", "日本語のテキストと中文字符", "emoji 😀👍🏽 and symbols ∑∫√",
    "mixed123abc456def7890", "x" * 300, "'s's't", "\u00a0nbsp\u2003em space\u3000ideographic", "\u017ftrange 'ſ",
    "line\u2028sep\u0085next\u000bvt\u001cfs", "",  "\n", " ", "!!!???...", "CamelCaseWordsHere and snake_case_words",
    "Café\u0301 combining", "Ⅻ roman ½ fraction ² superscript ١٢٣ arabic digits",
]
moby = open(os.path.join(root, "data/moby-dick/data.txt"), encoding="utf-8").read()
for start in (0, 5000, 200000, 700000):
    texts.append(moby[start:start + 1500])
json.dump(texts, open(os.path.join(out, "texts.json"), "w"), ensure_ascii=False)
print("wrote", out)

#!/usr/bin/env python3
"""Reference outputs for tests/data/tiktoken_tokenizer_test.cpp (megatron.cpp's TikTokenizer).

Inputs (written by the test with MT_WRITE_TIKTOKEN_FIXTURES=1, kept in the repository), in
tests/data/fixtures/tiktoken_ref/: vocab.json (Megatron-LM's vocabulary format: a JSON list of
{rank, token_bytes (base64), token_str}), texts.json (a list of texts), options.json
(num_special_tokens). The patterns are Megatron-LM's (megatron/core/tokenizers/text/libraries/
tiktoken_tokenizer.py, _PATTERN_TIKTOKEN_V1 / _V2), the special tokens Megatron's SPECIAL_TOKENS
then "<SPECIAL_{i}>" fillers, ranks shifted by num_special_tokens, as TikTokenTokenizer lays them out.

  python3 tools/tiktoken_ref.py pieces   # pieces.json: the pre-tokenizer's pieces per pattern and
                                         # text (Python's `regex` module; special tokens cut first)
  python3 tools/tiktoken_ref.py ids      # ids.json: tiktoken.Encoding(...).encode(text,
                                         # allowed_special="all") per pattern and text (needs the
                                         # tiktoken package; run it where it is installed)
  python3 tools/tiktoken_ref.py ids --educational PATH/tiktoken/_educational.py
                                         # the same ids from tiktoken's pure-Python reference BPE
                                         # (bpe_encode in the package's _educational.py, read from a
                                         # tiktoken checkout; no Rust core needed), the pieces cut as
                                         # `pieces` does and special tokens as their ids
"""
import base64
import json
import os
import sys

PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}|"
    " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "fixtures",
                    "tiktoken_ref")


def load():
    with open(os.path.join(HERE, "vocab.json")) as f:
        vocab = json.load(f)
    with open(os.path.join(HERE, "texts.json")) as f:
        texts = json.load(f)
    with open(os.path.join(HERE, "options.json")) as f:
        n_special = json.load(f)["num_special_tokens"]
    specials = SPECIAL_TOKENS + [f"<SPECIAL_{i}>" for i in range(len(SPECIAL_TOKENS), n_special)]
    ranks = {}
    for i, x in enumerate(vocab):
        assert x["rank"] == i
        ranks[base64.b64decode(x["token_bytes"])] = i + n_special
    return ranks, texts, specials


def split(text, pattern, special_re):
    """The text cut at special tokens, the parts between split by the pattern: yields (piece, is_special)."""
    pos = 0
    for m in list(special_re.finditer(text)) + [None]:
        end = m.start() if m else len(text)
        for p in pattern.finditer(text[pos:end]):
            yield p.group(), False
        if m:
            yield m.group(), True
            pos = m.end()


def special_regex(specials):
    import regex

    return regex.compile("|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)))


def pieces(texts, specials):
    import regex

    special_re = special_regex(specials)
    return {name: [[p for p, special in split(t, regex.compile(pat), special_re) if not special] for t in texts]
            for name, pat in PATTERNS.items()}


def ids(ranks, texts, specials):
    import tiktoken

    out = {}
    for name, pat in PATTERNS.items():
        enc = tiktoken.Encoding(name=f"megatron_{name}", pat_str=pat, mergeable_ranks=ranks,
                                special_tokens={s: i for i, s in enumerate(specials)})
        out[name] = [enc.encode(t, allowed_special="all") for t in texts]
    return out


def ids_educational(ranks, texts, specials, path):
    import types

    import regex

    sys.modules.setdefault("tiktoken", types.ModuleType("tiktoken"))  # _educational imports it for from_tiktoken only
    edu = types.ModuleType("tiktoken_educational")
    with open(path, encoding="utf-8") as f:
        exec(compile(f.read(), path, "exec"), edu.__dict__)
    special_ids = {s: i for i, s in enumerate(specials)}
    special_re = special_regex(specials)
    out = {}
    for name, pat in PATTERNS.items():
        r = regex.compile(pat)
        out[name] = [[i for p, special in split(t, r, special_re)
                      for i in ([special_ids[p]] if special else edu.bpe_encode(ranks, p.encode("utf-8"), visualise=None))]
                     for t in texts]
    return out


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    ranks, texts, specials = load()
    if what == "pieces":
        result = pieces(texts, specials)
    elif what == "ids" and len(sys.argv) == 4 and sys.argv[2] == "--educational":
        result = ids_educational(ranks, texts, specials, sys.argv[3])
    elif what == "ids":
        result = ids(ranks, texts, specials)
    else:
        sys.exit("usage: tiktoken_ref.py pieces | ids [--educational PATH/_educational.py]")
    path = os.path.join(HERE, f"{what}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

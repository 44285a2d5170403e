#!/usr/bin/env python3
"""Reference fixtures for megatron.cpp's Megatron-compatible data pipeline, computed with
Megatron-LM's own code.

Needs numpy (and, for the compiled helpers, pybind11 + a C++ compiler + Python headers). Megatron-LM
is NOT imported as a package (that would need torch and much more): the functions that build the
indices are taken from Megatron's source files by name (ast), with their annotations removed, and
executed with small stand-ins for logging / torch.distributed (not initialised) / the config object:
  gpt_dataset.py:    _build_document_index, _build_shuffle_index, GPTDataset._get_num_tokens_per_epoch,
                     GPTDataset._get_num_epochs, GPTDataset._build_document_sample_shuffle_indices,
                     GPTDataset._query_document_sample_shuffle_indices
  helpers.py + helpers.cpp (compiled here with pybind11; if that fails, a Python transliteration of
                     helpers.cpp in this file is used and the fixtures say so)
  utils.py:          normalize, get_blend_from_list
  blended_megatron_dataset_config.py: parse_and_normalize_split, convert_split_vector_to_split_matrix
  blended_megatron_dataset_builder.py: _get_size_per_split_per_dataset
The builder's split rounding `int(round(split[i][0] * float(num_elements)))` and its blend logic
(_build_blended_dataset_splits) are transcribed below (marked).

Usage:
  python3 tools/megatron_ref/gen_fixtures.py --megatron-datasets third_party_ref/megatron_core_datasets \
      --out tests/data/fixtures/megatron_ref
--megatron-datasets is a directory with those files (megatron/core/datasets of a Megatron-LM checkout,
or the copy in third_party_ref/, which is gitignored). Its COMMIT file (if any) is recorded.
"""
import argparse
import ast
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import types
from collections import OrderedDict
from enum import Enum

import numpy


# --------------------------------------------------------------------------------------------------
# Loading Megatron's functions
# --------------------------------------------------------------------------------------------------
class _StripAnnotations(ast.NodeTransformer):
    def visit_FunctionDef(self, node):
        node.returns = None
        for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
            a.annotation = None
        if node.args.vararg:
            node.args.vararg.annotation = None
        if node.args.kwarg:
            node.args.kwarg.annotation = None
        self.generic_visit(node)
        return node


class Split(Enum):
    train = 0
    valid = 1
    test = 2


def _base_namespace():
    torch_stub = types.SimpleNamespace(distributed=types.SimpleNamespace(is_initialized=lambda: False))
    return {
        "numpy": numpy, "os": os, "time": __import__("time"), "logging": logging, "math": __import__("math"),
        "re": __import__("re"), "functools": __import__("functools"), "ceil": __import__("math").ceil,
        "logger": logging.getLogger("megatron_ref"), "log_single_rank": lambda *a, **k: None,
        "torch": torch_stub, "Split": Split, "safe_numpy_load": numpy.load, "OrderedDict": OrderedDict,
    }


def load_functions(path, functions=(), class_name=None, methods=()):
    tree = ast.parse(open(path).read(), path)
    picked, found = [], set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in functions:
            picked.append(node)
            found.add(node.name)
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in methods:
                    picked.append(item)
                    found.add(item.name)
    missing = set(functions) | set(methods)
    missing -= found
    if missing:
        raise SystemExit(f"{path}: functions not found: {sorted(missing)}")
    mod = ast.fix_missing_locations(_StripAnnotations().visit(ast.Module(body=picked, type_ignores=[])))
    ns = _base_namespace()
    exec(compile(mod, path, "exec"), ns)
    return ns


# Python transliteration of helpers.cpp (used only when compiling it fails).
class HelpersTransliteration:
    @staticmethod
    def build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets, size, verbose):
        current = [0] * num_datasets
        for k in range(size):
            kd = max(float(k), 1.0)
            best, best_err = 0, weights[0] * kd - float(current[0])
            for d in range(1, num_datasets):
                err = weights[d] * kd - float(current[d])
                if err > best_err:
                    best, best_err = d, err
            dataset_index[k] = best
            dataset_sample_index[k] = current[best]
            current[best] += 1

    @staticmethod
    def build_exhaustive_blending_indices(dataset_index, dataset_sample_index, sizes, num_datasets):
        total = int(sum(sizes))
        weights = [sizes[i] / float(total) for i in range(num_datasets)]
        counts = [0] * num_datasets
        unspent = set(range(num_datasets))
        k = 0
        while unspent:
            kd = max(float(k), 1.0)
            best, best_err = -1, -sys.float_info.max
            for d in sorted(unspent):
                err = weights[d] * kd - float(counts[d])
                if err > best_err:
                    best, best_err = d, err
            dataset_index[k] = best
            dataset_sample_index[k] = counts[best]
            counts[best] += 1
            if sizes[best] - float(counts[best]) == 0:
                unspent.discard(best)
            k += 1

    @staticmethod
    def _build_sample_idx(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, extra, dtype):
        import math
        if drop_last:
            num_samples = (num_epochs * tokens_per_epoch - extra) // seq_length
        else:
            num_samples = math.ceil(float(numpy.float32(num_epochs * tokens_per_epoch - extra)) / seq_length)
        out = numpy.zeros((num_samples + 1, 2), dtype=dtype)
        s, pos, off = 1, 0, 0
        while s <= num_samples:
            remaining = seq_length + extra
            while remaining != 0:
                doc_len = int(sizes[document_idx[pos]]) - off
                remaining -= doc_len
                if remaining <= 0:
                    off += remaining + doc_len - extra
                    remaining = 0
                else:
                    if pos == len(document_idx) - 1:
                        assert s == num_samples
                        off = int(sizes[document_idx[pos]]) - extra
                        break
                    pos += 1
                    off = 0
            out[s] = (pos, off)
            s += 1
        return out

    @staticmethod
    def build_sample_idx_int32(*a):
        return HelpersTransliteration._build_sample_idx(*a, numpy.int32)

    @staticmethod
    def build_sample_idx_int64(*a):
        return HelpersTransliteration._build_sample_idx(*a, numpy.int64)


def load_helpers(mdir, build_dir):
    """Megatron's helpers module: helpers.py on top of helpers.cpp compiled with pybind11."""
    how = None
    try:
        import pybind11

        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        out = os.path.join(build_dir, "helpers_cpp" + suffix)
        cmd = ["c++", "-O2", "-shared", "-std=c++17", "-fPIC", "-I" + pybind11.get_include(),
               "-I" + sysconfig.get_paths()["include"], os.path.join(mdir, "helpers.cpp"), "-o", out]
        subprocess.run(cmd, check=True, capture_output=True)
        spec = importlib.util.spec_from_file_location("helpers_cpp", out)
        cpp = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cpp)
        how = "helpers.cpp compiled with pybind11"
    except Exception as e:  # noqa: BLE001
        print(f"warning: compiling helpers.cpp failed ({e}); using the Python transliteration", file=sys.stderr)
        cpp = HelpersTransliteration
        how = "Python transliteration of helpers.cpp (tools/megatron_ref/gen_fixtures.py)"
    # helpers.py does `from megatron.core.datasets.helpers_cpp import *`: provide that module.
    for name in ["megatron", "megatron.core", "megatron.core.datasets"]:
        sys.modules.setdefault(name, types.ModuleType(name))
    cpp_mod = types.ModuleType("megatron.core.datasets.helpers_cpp")
    for k in ["build_sample_idx_int32", "build_sample_idx_int64", "build_blending_indices",
              "build_exhaustive_blending_indices"]:
        setattr(cpp_mod, k, getattr(cpp, k))
    sys.modules["megatron.core.datasets.helpers_cpp"] = cpp_mod
    helpers = types.ModuleType("megatron.core.datasets.helpers")
    exec(compile(open(os.path.join(mdir, "helpers.py")).read(), "helpers.py", "exec"), helpers.__dict__)
    sys.modules["megatron.core.datasets.helpers"] = helpers
    sys.modules["megatron.core.datasets"].helpers = helpers
    return helpers, how


# --------------------------------------------------------------------------------------------------
# A deterministic corpus (also regenerated by the C++ test from the same rule)
# --------------------------------------------------------------------------------------------------
def corpus_lengths(n, seed, max_len):
    """LCG (Numerical Recipes constants) lengths in [1, max_len]."""
    x, out = seed, []
    for _ in range(n):
        x = (1664525 * x + 1013904223) % 2**32
        out.append(1 + (x >> 8) % max_len)
    return out


def token(corpus_id, seq, pos):
    return (corpus_id * 7919 + seq * 131 + pos * 7) % 50257


class LowLevel:
    """Stand-in for IndexedDataset: sequence_lengths and get(idx, offset, length)."""

    def __init__(self, corpus_id, lengths):
        self.corpus_id = corpus_id
        self.sequence_lengths = numpy.array(lengths, dtype=numpy.int32)
        self.path_prefix = f"corpus{corpus_id}"

    def get(self, idx, offset=0, length=None):
        n = int(self.sequence_lengths[idx])
        if length is None:
            length = n - offset
        toks = [token(self.corpus_id, int(idx), p) for p in range(n)]
        return numpy.array(toks[offset:offset + length], dtype=numpy.int64)


class Megatron:
    def __init__(self, mdir, build_dir):
        self.helpers, self.helpers_how = load_helpers(mdir, build_dir)
        self.gpt = load_functions(
            os.path.join(mdir, "gpt_dataset.py"), ["_build_document_index", "_build_shuffle_index"], "GPTDataset",
            ["_get_num_tokens_per_epoch", "_get_num_epochs", "_build_document_sample_shuffle_indices",
             "_query_document_sample_shuffle_indices"])
        self.utils = load_functions(os.path.join(mdir, "utils.py"), ["normalize", "get_blend_from_list"])
        self.cfg = load_functions(os.path.join(mdir, "blended_megatron_dataset_config.py"),
                                  ["parse_and_normalize_split", "convert_split_vector_to_split_matrix"])
        self.cfg["normalize"] = self.utils["normalize"]
        self.builder = load_functions(os.path.join(mdir, "blended_megatron_dataset_builder.py"),
                                      ["_get_size_per_split_per_dataset"])

        g = self.gpt

        class GPTDataset:  # the name matters: Megatron uses type(self).__name__
            _get_num_tokens_per_epoch = g["_get_num_tokens_per_epoch"]
            _get_num_epochs = g["_get_num_epochs"]
            _build_document_sample_shuffle_indices = g["_build_document_sample_shuffle_indices"]
            _query_document_sample_shuffle_indices = g["_query_document_sample_shuffle_indices"]

        self.GPTDataset = GPTDataset

    def split_matrix(self, split):
        return self.cfg["convert_split_vector_to_split_matrix"](self.cfg["parse_and_normalize_split"](split))

    def gpt_dataset(self, low, split_bookends, num_samples, index_split, seq_length, seed):
        """GPTDataset(low, ..., indices, num_samples, split, config) without caching."""
        n = len(low.sequence_lengths)
        # --- transcribed from BlendedMegatronDatasetBuilder._build_megatron_dataset_splits ---
        beg = int(round(split_bookends[0] * float(n)))
        end = int(round(split_bookends[1] * float(n)))
        ds = self.GPTDataset()
        ds.dataset = low
        ds.indices = numpy.arange(start=beg, stop=end, step=1, dtype=numpy.int32)
        ds.num_samples = num_samples
        ds.index_split = index_split
        ds._pad_token_id = -1
        ds.unique_description_hash = "x"
        ds.config = types.SimpleNamespace(
            defer_npy_index_mmap=False, path_to_cache=None, mock=True, fast_cache_load=False,
            sequence_length=seq_length, random_seed=seed, add_extra_token_to_sequence=True,
            drop_last_partial_validation_sequence=True)
        ds.document_index, ds.sample_index, ds.shuffle_index = ds._build_document_sample_shuffle_indices()
        ds.range = (beg, end)
        return ds

    def sample(self, ds, i):
        text, _, _ = ds._query_document_sample_shuffle_indices(i)
        return [int(t) for t in text]


# --------------------------------------------------------------------------------------------------
def gpt_case(meg, corpus, split, split_index, seq_length, num_samples, seed, n_show=6):
    low = LowLevel(corpus["id"], corpus["lengths"])
    bookends = meg.split_matrix(split)[split_index]
    ds = meg.gpt_dataset(low, bookends, num_samples, Split(split_index), seq_length, seed)
    n = ds.sample_index.shape[0] - 1
    show = sorted(set([0, 1, n // 2, n - 1] + list(range(min(n_show, n)))))
    return OrderedDict(
        corpus=corpus["id"], split=split, split_index=split_index, seq_length=seq_length, num_samples=num_samples,
        seed=seed, sequence_range=list(ds.range), num_epochs=int(ds._get_num_epochs(ds._get_num_tokens_per_epoch())),
        document_index=[int(x) for x in ds.document_index], sample_index=[int(x) for x in ds.sample_index.reshape(-1)],
        shuffle_index=[int(x) for x in ds.shuffle_index],
        samples=OrderedDict((str(i), meg.sample(ds, i)) for i in show))


def blend_case(meg, corpora, data_path, split, sizes, seq_length, seed, surplus=0.005, n_show=8):
    """--- transcribed from BlendedMegatronDatasetBuilder._build_blended_dataset_splits (blend branch) ---"""
    prefixes, weights = meg.utils["get_blend_from_list"](data_path)
    by_name = {c["name"]: c for c in corpora}
    split_m = meg.split_matrix(split)
    if weights is not None:
        weights = meg.utils["normalize"](weights)
        targets = meg.builder["_get_size_per_split_per_dataset"](weights, sizes)
        buffers = meg.builder["_get_size_per_split_per_dataset"](weights, sizes, surplus=surplus)
    else:
        buffers = [[None] * 3 for _ in prefixes]
    mids = []
    for d, p in enumerate(prefixes):
        c = by_name[p]
        low = LowLevel(c["id"], c["lengths"])
        mids.append([None if split_m[i] is None else
                     meg.gpt_dataset(low, split_m[i], buffers[d][i], Split(i), seq_length, seed) for i in range(3)])
    out = OrderedDict(data_path=data_path, split=split, sizes=sizes, seq_length=seq_length, seed=seed,
                      surplus=surplus, normalized_weights=weights, splits=[])
    for i in range(3):
        if split_m[i] is None:
            out["splits"].append(None)
            continue
        if weights is not None:
            w_i = weights
            size_i = sum(list(zip(*targets))[i])
        else:
            w_i = [m[i].sample_index.shape[0] - 1 for m in mids]
            size_i = min(sizes[i], sum(w_i))
        w_i = meg.utils["normalize"](w_i)  # BlendedDataset normalises when size is not None
        di = numpy.zeros(size_i, dtype=numpy.int16)
        dsi = numpy.zeros(size_i, dtype=numpy.int64)
        meg.helpers.build_blending_indices(di, dsi, w_i, len(mids), size_i, False)
        samples = OrderedDict()
        for k in range(min(n_show, size_i)):
            samples[str(k)] = meg.sample(mids[int(di[k])][i], int(dsi[k]))
        out["splits"].append(OrderedDict(
            size=size_i, weights=w_i,
            mid_sizes=[int(m[i].sample_index.shape[0] - 1) for m in mids],
            mid_num_samples=[m[i].num_samples for m in mids],
            dataset_index=[int(x) for x in di], dataset_sample_index=[int(x) for x in dsi], samples=samples))
    return out


def numpy_cases():
    from numpy.random import RandomState
    shuffles = []
    for seed, n in [(0, 10), (1, 2), (5, 1000), (1234, 257), (2**32 - 1, 77), (3735928559, 4097)]:
        a = numpy.arange(n, dtype=numpy.int32)
        RandomState(seed).shuffle(a)
        shuffles.append(OrderedDict(seed=seed, n=n, result=[int(x) for x in a]))
    intervals = []
    for seed, mx, k in [(5, 10**10, 20), (99, 2**40 + 12345, 20), (7, 2**63 - 1, 10)]:
        v = RandomState(seed).randint(0, mx + 1, size=k, dtype=numpy.int64)  # masked rejection = random_interval
        intervals.append(OrderedDict(seed=seed, max=mx, result=[int(x) for x in v]))
    mock = numpy.random.default_rng(seed=0).integers(low=1, high=4096, size=100000, dtype=numpy.int32)
    ints = []
    for seed, lo, hi, k in [(0, 1, 4096, 30), (12345678901234, -5, 100000, 20), (2**40 + 3, 0, 2**31 - 1, 20),
                            (77, 10, 11, 5)]:
        ints.append(OrderedDict(seed=seed, low=lo, high=hi,
                                result=[int(x) for x in numpy.random.default_rng(seed).integers(lo, hi, size=k,
                                                                                                 dtype=numpy.int32)]))
    rs = numpy.random.RandomState(4242)
    w300 = [float(x) for x in rs.uniform(0.01, 10.0, size=300)]
    return OrderedDict(
        numpy_version=numpy.__version__, shuffles=shuffles, random_interval=intervals, integers_int32=ints,
        mock_lengths=OrderedDict(first=[int(x) for x in mock[:40]], last=[int(x) for x in mock[-10:]],
                                 sum=int(mock.astype(numpy.int64).sum()),
                                 md5=hashlib.md5(mock.astype("<i4").tobytes()).hexdigest()),
        weights300=w300)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron-datasets", default="third_party_ref/megatron_core_datasets")
    ap.add_argument("--out", default="tests/data/fixtures/megatron_ref")
    args = ap.parse_args()
    mdir = args.megatron_datasets
    commit_file = os.path.join(mdir, "COMMIT")
    commit = open(commit_file).read().strip() if os.path.exists(commit_file) else "unknown"
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as build_dir:
        meg = Megatron(mdir, build_dir)
        corpora = [
            OrderedDict(id=1, name="corpusA", lengths=corpus_lengths(60, 11, 90)),
            OrderedDict(id=2, name="corpusB", lengths=corpus_lengths(23, 22, 40)),
            OrderedDict(id=3, name="corpusC", lengths=corpus_lengths(41, 33, 150)),
        ]
        A = corpora[0]
        gpt = [
            gpt_case(meg, A, "969,30,1", 0, 16, 50, 1234),      # one epoch
            gpt_case(meg, A, "969,30,1", 0, 16, 700, 1234),     # several epochs
            gpt_case(meg, A, "969,30,1", 0, 16, 460, 1234),     # several epochs, other final-epoch rule
            gpt_case(meg, A, "80,15,5", 1, 8, 100, 7),          # valid split
            gpt_case(meg, A, "80,15,5", 2, 8, 33, 2**32 - 1),   # test split, largest seed
            gpt_case(meg, A, "1", 0, 32, None, 0),              # num_samples None: one epoch
            gpt_case(meg, A, "98,2", 0, 5, 1000, 42),
        ]
        # Which cases used a separate final epoch (the recorded shuffle shows it; state it for the reader).
        blends = [
            blend_case(meg, corpora, ["30", "corpusA", "50", "corpusB", "20", "corpusC"], "80,15,5", [200, 40, 10],
                       16, 1234),
            blend_case(meg, corpora, ["corpusA", "corpusC"], "70,20,10", [100, 20, 5], 12, 5),
            blend_case(meg, corpora, ["1", "corpusB"], "1", [64, 0, 0], 8, 99),
        ]
        exhaustive = []
        for sizes in [[5, 3, 7], [1, 1], [10, 1, 2, 30]]:
            n = sum(sizes)
            di = numpy.zeros(n, dtype=numpy.int16)
            dsi = numpy.zeros(n, dtype=numpy.int64)
            meg.helpers.build_exhaustive_blending_indices(di, dsi, numpy.array(sizes, dtype=numpy.int64), len(sizes))
            exhaustive.append(OrderedDict(sizes=sizes, dataset_index=[int(x) for x in di],
                                          dataset_sample_index=[int(x) for x in dsi]))
        sample_idx_cases = []
        for sizes, doc_idx, seq, epochs, drop_last in [([5, 9, 3, 12], [2, 0, 3, 1, 0, 1, 2, 3], 4, 2, False),
                                                        ([7, 1, 30], [1, 2, 0], 6, 1, False),
                                                        ([7, 1, 30], [1, 2, 0], 6, 1, True)]:
            tpe = sum(sizes)
            si = meg.helpers.build_sample_idx(numpy.array(sizes, dtype=numpy.int32),
                                              numpy.array(doc_idx, dtype=numpy.int32), seq, epochs, tpe, drop_last,
                                              True)
            sample_idx_cases.append(OrderedDict(sizes=sizes, document_index=doc_idx, seq_length=seq,
                                                num_epochs=epochs, tokens_per_epoch=tpe, drop_last=drop_last,
                                                sample_index=[int(x) for x in si.reshape(-1)]))
        normalized300 = meg.utils["normalize"](numpy_cases()["weights300"])
        meta = OrderedDict(
            megatron_commit=commit, helpers=meg.helpers_how, numpy_version=numpy.__version__,
            python=sys.version.split()[0],
            method="Megatron-LM functions executed from its source (see tools/megatron_ref/gen_fixtures.py)",
            token_rule="token(corpus_id, seq, pos) = (corpus_id * 7919 + seq * 131 + pos * 7) % 50257",
            corpus_rule="lengths: x = (1664525 * x + 1013904223) mod 2^32 from x = seed; length = 1 + (x >> 8) % max_len")
        with open(os.path.join(args.out, "gpt.json"), "w") as f:
            json.dump(OrderedDict(meta=meta, corpora=corpora, gpt=gpt, sample_index=sample_idx_cases), f)
        with open(os.path.join(args.out, "blend.json"), "w") as f:
            nc = numpy_cases()
            json.dump(OrderedDict(meta=meta, corpora=corpora, blends=blends, exhaustive=exhaustive,
                                  weights300=nc["weights300"], normalized300=normalized300), f)
        with open(os.path.join(args.out, "numpy.json"), "w") as f:
            json.dump(OrderedDict(meta=meta, **numpy_cases()), f)
        print(f"wrote {args.out}/{{gpt,blend,numpy}}.json (helpers: {meg.helpers_how}; Megatron {commit})")


if __name__ == "__main__":
    main()

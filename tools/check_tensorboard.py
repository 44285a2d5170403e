#!/usr/bin/env python3
"""Reads the scalars of a TensorBoard log directory (or one event file) and checks them.

By default the file is read by the real `tensorboard` package
(tensorboard.backend.event_processing.event_accumulator.EventAccumulator), the reader that the
TensorBoard UI uses for legacy `simple_value` scalars, which is what megatron.cpp's
src/train/tensorboard.cpp writes (and what torch.utils.tensorboard.SummaryWriter.add_scalar writes
for Megatron-LM). `--reader builtin` uses a small pure-Python TFRecord/protobuf reader instead (it
verifies both masked CRC-32Cs of every record); it is for machines without tensorboard and is not
a substitute for the real check.

Prints, per tag, the number of points, the step range and the first and last values (every point
with --verbose), then checks the expectations:
  --expect "TAG@STEP=VALUE"      (repeatable) a point that must be there, e.g. "lm loss@10=7.25"
  --expect-json FILE             {"TAG": {"STEP": VALUE, ...}, ...} or {"TAG": [[STEP, VALUE], ...]}
  --require-tag "TAG[=N]"        (repeatable) the tag must be present (with exactly N points)
  --exact-tags                   the file's tags must be exactly the tags expected/required
Values compare as |got - want| <= atol + rtol * |want| (NaN equals NaN); the file stores float32,
so the default rtol is 1e-6. When a step appears more than once for a tag, the last one counts.

Exit status: 0 all checks pass; 1 a check failed; 2 bad usage, an unreadable or corrupt file,
no scalars at all, or the tensorboard package missing.

Examples:
  python3 tools/check_tensorboard.py runs/tb --require-tag "lm loss=4" --require-tag learning-rate
  MT_TENSORBOARD_TEST_OUT=/tmp/tb ./build/tensorboard_test --gtest_filter='*RoundTrip*'
  python3 tools/check_tensorboard.py /tmp/tb --expect-json /tmp/tb/expected.json --exact-tags
"""
import argparse
import json
import math
import os
import struct
import sys


def die(msg):
    """Bad usage, an unreadable input or a missing package: exit status 2."""
    print(f"check_tensorboard: {msg}", file=sys.stderr)
    sys.exit(2)


def read_with_tensorboard(path):
    """{tag: [(step, value, wall_time), ...]} via tensorboard's EventAccumulator."""
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError as e:  # pragma: no cover - depends on the machine
        die(f"the tensorboard package is not installed ({e}); use --reader builtin for the "
            "pure-Python reader")
    acc = event_accumulator.EventAccumulator(
        path, size_guidance={event_accumulator.SCALARS: 0}, purge_orphaned_data=False)
    acc.Reload()
    out = {}
    for tag in acc.Tags().get("scalars", []):
        out[tag] = [(ev.step, float(ev.value), ev.wall_time) for ev in acc.Scalars(tag)]
    return out


# ---- builtin reader: TFRecord framing + the three protobuf messages ----------------------

def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class CorruptFile(Exception):
    pass


def _fields(buf, where):
    """Yields (field, wire_type, value) of one protobuf message; value is int or bytes."""
    pos, n = 0, len(buf)

    def varint():
        nonlocal pos
        v, shift = 0, 0
        while True:
            if pos >= n or shift > 63:
                raise CorruptFile(f"{where}: malformed protobuf (bad varint)")
            b = buf[pos]
            pos += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return v

    while pos < n:
        key = varint()
        field, wt = key >> 3, key & 7
        if wt == 0:
            val = varint()
        elif wt in (1, 5, 2):
            size = 8 if wt == 1 else 4 if wt == 5 else varint()
            if pos + size > n:
                raise CorruptFile(f"{where}: malformed protobuf (field {field} past the end)")
            val = bytes(buf[pos:pos + size])
            pos += size
        else:
            raise CorruptFile(f"{where}: malformed protobuf (wire type {wt})")
        yield field, wt, val


def read_event_file_builtin(path, out):
    with open(path, "rb") as f:
        data = f.read()
    pos, record = 0, 0
    while pos < len(data):
        where = f"{path} record {record} (offset {pos})"
        if len(data) - pos < 12:
            raise CorruptFile(f"{where}: truncated header")
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        if length_crc != masked_crc32c(header):
            raise CorruptFile(f"{where}: length CRC mismatch")
        if pos + 12 + length + 4 > len(data):
            raise CorruptFile(f"{where}: truncated (length {length})")
        payload = data[pos + 12:pos + 12 + length]
        (data_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        if data_crc != masked_crc32c(payload):
            raise CorruptFile(f"{where}: data CRC mismatch")
        wall_time, step, summaries = 0.0, 0, []
        for field, wt, val in _fields(payload, where):
            if field == 1 and wt == 1:
                (wall_time,) = struct.unpack("<d", val)
            elif field == 2 and wt == 0:
                step = val - (1 << 64) if val >= (1 << 63) else val
            elif field == 5 and wt == 2:
                summaries.append(val)
        for s in summaries:
            for field, wt, val in _fields(s, where):
                if field != 1 or wt != 2:
                    continue
                tag, value = None, None
                for vf, vwt, vv in _fields(val, where):
                    if vf == 1 and vwt == 2:
                        tag = vv.decode("utf-8", errors="replace")
                    elif vf == 2 and vwt == 5:
                        (value,) = struct.unpack("<f", vv)
                if tag is not None and value is not None:
                    out.setdefault(tag, []).append((step, value, wall_time))
        pos += 16 + length
        record += 1


def read_builtin(path):
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if "tfevents" in f)
    else:
        files = [path]
    out = {}
    for f in files:
        read_event_file_builtin(f, out)
    return out


# ---- expectations ------------------------------------------------------------------------

def parse_expect(text):
    """'TAG@STEP=VALUE' -> (tag, step, value); the tag may contain '@' and '='."""
    head, sep, value = text.rpartition("=")
    tag, sep2, step = head.rpartition("@")
    if not sep or not sep2 or not tag:
        die(f"--expect '{text}': expected TAG@STEP=VALUE")
    try:
        return tag, int(step), float(value)
    except ValueError:
        die(f"--expect '{text}': STEP must be an integer and VALUE a number")


def load_expect_json(path):
    try:
        with open(path) as f:
            doc = json.load(f)
        if not isinstance(doc, dict):
            raise ValueError("expected an object {tag: {step: value}} or {tag: [[step, value]]}")
        out = []
        for tag, points in doc.items():
            items = points.items() if isinstance(points, dict) else points
            for step, value in items:
                out.append((tag, int(step), float(value)))
        return out
    except (OSError, ValueError, TypeError) as e:
        die(f"--expect-json {path}: {e}")


def close(got, want, rtol, atol):
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    if math.isinf(want) or math.isinf(got):
        return got == want
    return abs(got - want) <= atol + rtol * abs(want)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("path", help="log directory (--tensorboard-dir) or one events.out.tfevents.* file")
    ap.add_argument("--expect", action="append", default=[], metavar="TAG@STEP=VALUE")
    ap.add_argument("--expect-json", metavar="FILE")
    ap.add_argument("--require-tag", action="append", default=[], metavar="TAG[=N]")
    ap.add_argument("--exact-tags", action="store_true")
    ap.add_argument("--rtol", type=float, default=1e-6)
    ap.add_argument("--atol", type=float, default=0.0)
    ap.add_argument("--reader", choices=["tensorboard", "builtin"], default="tensorboard")
    ap.add_argument("--verbose", action="store_true", help="print every point")
    args = ap.parse_args(argv)

    expects = [parse_expect(e) for e in args.expect]
    if args.expect_json:
        expects += load_expect_json(args.expect_json)
    required = {}
    for r in args.require_tag:
        tag, sep, n = r.rpartition("=")
        if sep and n.isdigit():
            required[tag] = int(n)
        else:
            required[r] = None

    if not os.path.exists(args.path):
        print(f"check_tensorboard: {args.path}: no such file or directory", file=sys.stderr)
        return 2
    try:
        scalars = read_with_tensorboard(args.path) if args.reader == "tensorboard" else read_builtin(args.path)
    except (CorruptFile, OSError) as e:
        print(f"check_tensorboard: {e}", file=sys.stderr)
        return 2
    print(f"reader: {args.reader}; {args.path}")
    if not scalars:
        print(f"check_tensorboard: {args.path}: no scalars", file=sys.stderr)
        return 2
    for tag in sorted(scalars):
        pts = scalars[tag]
        steps = [p[0] for p in pts]
        print(f"  {tag!r}: {len(pts)} points, steps {min(steps)}..{max(steps)}, "
              f"first {pts[0][1]:.9g} (step {pts[0][0]}), last {pts[-1][1]:.9g} (step {pts[-1][0]})")
        if args.verbose:
            for step, value, wall in pts:
                print(f"      step {step}: {value:.9g}  (wall {wall:.3f})")

    failures = []
    for tag, step, want in expects:
        by_step = {p[0]: p[1] for p in scalars.get(tag, [])}
        if tag not in scalars:
            failures.append(f"{tag!r}@{step}: tag missing")
        elif step not in by_step:
            failures.append(f"{tag!r}@{step}: step missing (steps {sorted(by_step)})")
        elif not close(by_step[step], want, args.rtol, args.atol):
            failures.append(f"{tag!r}@{step}: got {by_step[step]:.9g}, want {want:.9g} "
                            f"(rtol {args.rtol}, atol {args.atol})")
    for tag, n in required.items():
        if tag not in scalars:
            failures.append(f"{tag!r}: required tag missing")
        elif n is not None and len(scalars[tag]) != n:
            failures.append(f"{tag!r}: {len(scalars[tag])} points, want {n}")
    if args.exact_tags:
        want_tags = {e[0] for e in expects} | set(required)
        extra, missing = set(scalars) - want_tags, want_tags - set(scalars)
        if extra or missing:
            failures.append(f"tags differ: unexpected {sorted(extra)}, missing {sorted(missing)}")

    checks = len(expects) + len(required) + (1 if args.exact_tags else 0)
    for f in failures:
        print(f"MISMATCH {f}")
    print(f"{checks - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

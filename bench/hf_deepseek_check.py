#!/usr/bin/env python3
"""DeepseekV3ForCausalLM and DeepseekV2ForCausalLM round trips against transformers (issue 43;
docs/huggingface.md "DeepSeek-V3", "DeepSeek-V2").

For each small random configuration below, made here with transformers and saved with
save_pretrained (fp32):
  1. import:  `megatron import-hf`, then `megatron logits` on 24 fixed tokens, on every --devices
              entry (cpu, cuda), against transformers' fp32 logits of the same model;
  2. export:  `megatron export-hf --hf-dtype fp32` of the imported checkpoint, loaded by
              transformers (DeepseekV3ForCausalLM.from_pretrained): its logits against the original's;
  3. trained: (first configuration) `megatron pretrain --finetune` 3 steps on mock data (the weights,
              the expert biases and the MTP layer move), exported, loaded by transformers: its logits
              against `megatron logits` of the trained checkpoint.
The dsv2-* configurations (--families v2) are DeepseekV2ForCausalLM, steps 1 and 2 only: routed
scaling factor 1.5, two shared experts, top-2, and one feature at a time on a base model
(dsv2-base: 'group_limited_greedy' with top-k = topk_group, no q-lora, default RoPE, tied) so that
a failure names its feature: dsv2+greedy ('greedy' routing), dsv2+q-lora (q_a_proj / q_a_layernorm
/ q_b_proj), dsv2+yarn (YaRN with mscale = mscale_all_dim = 0.707, DeepSeek-V2's released configs:
cos and sin unscaled, the softmax by get_mscale(4, 0.707)² = 1.206), dsv2+yarn-ratio (mscale 0.9 /
mscale_all_dim 0.7: cos and sin scaled too), dsv2+untied (lm_head); dsv2-all has greedy + q-lora +
YaRN + untied. transformers' DeepseekV2 scales the softmax by get_mscale² only from 5.17
(huggingface/transformers#47435); megatron.cpp follows that (and DeepSeek's code), so with an older
transformers the YaRN cases FAIL: the script prints transformers' softmax scale for each YaRN case
and says which convention it follows. --labels runs a subset (e.g. --labels dsv2+yarn dsv2-all).
The "+mtp" configuration adds DeepSeek's MTP layer (model.layers.<num_hidden_layers>.{enorm, hnorm,
eh_proj, shared_head.*, embed_tokens, the layer's own tensors}) to the saved safetensors, as
DeepSeek's checkpoints hold it (transformers itself drops it); the exported MTP tensors must equal
the injected ones bit for bit.

Tolerances. Both sides compute in fp32; the differences come from summation order and fp32
transcendentals: the CPU test (tests/model/hf_deepseek_test.cpp) measures 1.5e-7..1.1e-6 against a
float64 forward, and its negative controls (the other RoPE pairing, a missing expert bias) move the
logits by more than 1e-3. So megatron.cpp vs transformers passes below a normwise relative error of
1e-4 (100x the fp32 noise, 10x below any mapping error seen); the export check compares transformers
with itself on the same fp32 weights and passes below 1e-6 (expected: 0). The routing margin (the
smallest gap between a chosen and a rejected expert or group score, from transformers' router) is
printed: below 1e-5 a FAIL may be an fp32 near-tie rather than a mapping error.

usage: python3 bench/hf_deepseek_check.py BUILD/megatron WORKDIR [--devices cpu cuda] [--families v3 v2]
                                         [--labels LABEL ...]
Prints one line per check, then PASS or FAIL; exit status 1 on any FAIL. About 1 minute (v3) plus
about 1 minute (the seven v2 models).
"""
import argparse
import os
import shutil
import subprocess
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

TOKENS = 24
VOCAB = 1000


def config(label):
    """A small DeepSeek-V3-shaped configuration: 3 layers (layer 0 dense), MLA, 8 routed experts in
    4 groups (top-4 from the best 2 groups: 4 = 2 * topk_group as DeepSeek-V3's 8 = 2 * 4), 1 shared
    expert, sigmoid routing with e_score_correction_bias."""
    yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                beta_fast=32.0, beta_slow=1.0, mscale=0.9, mscale_all_dim=0.7)
    c = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
             routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=12,
             qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
             norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
             rope_interleave=True, rope_parameters=yarn)
    if label == "dsv3-no-q-lora-rotate-half-default-rope-tied":
        # q_proj instead of q_a/q_b; transformers' rotate-half pairs (import permutes the rope rows);
        # plain RoPE; tied embeddings; groups that restrict nothing (n_group 1).
        c.update(q_lora_rank=None, rope_interleave=False, tie_word_embeddings=True, n_group=1, topk_group=1,
                 num_experts_per_tok=2, rope_parameters=dict(rope_type="default", rope_theta=50000.0))
    if label == "dsv3-yarn+mtp":
        c.update(num_nextn_predict_layers=1)
    if label.startswith("dsv2"):
        # DeepseekV2Config has neither rope_interleave (always interleaved) nor norm_topk_prob's effect.
        # The base: group-limited (top-k = topk_group), no q-lora, default RoPE, tied; then the
        # label's features.
        c.pop("rope_interleave")
        c.update(topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=False,
                 num_experts_per_tok=2, n_shared_experts=2, routed_scaling_factor=1.5, q_lora_rank=None,
                 tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=50000.0))
        features = V2_FEATURES[label]
        if "greedy" in features:
            c.update(topk_method="greedy", n_group=None, topk_group=None)
        if "q-lora" in features:
            c.update(q_lora_rank=32)
        if "yarn" in features:
            c.update(rope_parameters=dict(yarn, mscale=0.707, mscale_all_dim=0.707))
        if "yarn-ratio" in features:
            c.update(rope_parameters=dict(yarn, mscale=0.9, mscale_all_dim=0.7))
        if "untied" in features:
            c.update(tie_word_embeddings=False)
    if int(transformers.__version__.split(".")[0]) < 5:  # transformers 4: rope_scaling + rope_theta
        rp = dict(c.pop("rope_parameters"))
        c["rope_theta"] = rp.pop("rope_theta")
        c["rope_scaling"] = None if rp["rope_type"] == "default" else dict(rp, type=rp["rope_type"])
    return (transformers.DeepseekV2Config if label.startswith("dsv2") else transformers.DeepseekV3Config)(**c)


V2_FEATURES = {"dsv2-base": (), "dsv2+greedy": ("greedy",), "dsv2+q-lora": ("q-lora",), "dsv2+yarn": ("yarn",),
               "dsv2+yarn-ratio": ("yarn-ratio",), "dsv2+untied": ("untied",),
               "dsv2-all": ("greedy", "q-lora", "yarn", "untied")}
LABELS = {"v3": ["dsv3-yarn", "dsv3-no-q-lora-rotate-half-default-rope-tied", "dsv3-yarn+mtp"],
          "v2": list(V2_FEATURES)}


def v2_softmax_note(model, cfg):
    """For a YaRN DeepseekV2: transformers' softmax scale against 1/sqrt(d_n + d_r) · get_mscale(factor,
    mscale_all_dim)² (what megatron.cpp imports) and 1/sqrt(d_n + d_r) (transformers <= 5.16)."""
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rp.get("rope_type", rp.get("type", "default")) == "default":
        return ""
    plain = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    f, m = rp["factor"], rp.get("mscale_all_dim") or 0
    ms = 1.0 if f <= 1 or not m else 0.1 * m * np.log(f) + 1.0
    got = model.model.layers[0].self_attn.scaling
    if abs(got - plain * ms * ms) < 1e-6 * plain:
        which = "x get_mscale^2, as megatron.cpp"
    elif abs(got - plain) < 1e-6 * plain:
        which = "WITHOUT get_mscale^2 (transformers < 5.17): the import check is expected to FAIL"
    else:
        which = "neither convention"
    return f", transformers' softmax scale {got:.6f} ({which})"


def randomize(model, gen):
    """Norms near 1, router weights of std 1 (well separated choices), other weights std 0.1,
    expert biases in [0, 1) (non-negative: transformers masks the groups not chosen with 0, so a
    negative score + bias could pick a masked expert where Megatron's -inf mask does not)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=gen))


class RoutingMarginV2:
    """The same for DeepseekV2Moe.route_tokens_to_experts (softmax probabilities; a group scored by its
    best one), recomputed from the MoE block's input (its gate weight is applied functionally)."""

    def __init__(self, model):
        self.margin = float("inf")
        self.cfg = model.config
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.register_forward_pre_hook(self.hook)

    def hook(self, module, inputs):
        c = self.cfg
        x = inputs[0]
        p = (x.reshape(-1, x.shape[-1]).float() @ module.gate.weight.float().t()).softmax(dim=-1)
        if c.topk_method == "group_limited_greedy":
            groups = p.view(-1, c.n_group, c.n_routed_experts // c.n_group)
            group_score = groups.max(dim=-1).values
            self.margin = min(self.margin, RoutingMargin.gap(group_score, c.topk_group))
            keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(c.topk_group, dim=-1).indices, 1)
            p = (groups * keep.unsqueeze(-1)).view(-1, c.n_routed_experts)
        self.margin = min(self.margin, RoutingMargin.gap(p, c.num_experts_per_tok))


class RoutingMargin:
    """The smallest gap between a selected and a rejected score of transformers' routing
    (DeepseekV3MoE.route_tokens_to_experts), from the router logits its gate returns."""

    def __init__(self, model):
        self.margin = float("inf")
        self.cfg = model.config
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.register_forward_hook(self.hook)

    @staticmethod
    def gap(v, k):
        s = torch.sort(v, dim=-1, descending=True).values
        return float((s[..., k - 1] - s[..., k]).min()) if k < v.shape[-1] else float("inf")

    def hook(self, module, inputs, out):
        if not torch.is_tensor(out):  # transformers 4's gate returns the choice itself
            return
        c = self.cfg
        choice = out.float().sigmoid() + module.e_score_correction_bias.float()
        groups = choice.view(-1, c.n_group, c.n_routed_experts // c.n_group)
        group_score = groups.topk(2, dim=-1).values.sum(-1)
        self.margin = min(self.margin, self.gap(group_score, c.topk_group))
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(c.topk_group, dim=-1).indices, 1)
        masked = (groups * keep.unsqueeze(-1)).view(-1, c.n_routed_experts)
        self.margin = min(self.margin, self.gap(masked, c.num_experts_per_tok))


def run(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print(r.stdout[-4000:])
        raise SystemExit(f"command failed ({r.returncode}): {' '.join(cmd)}")
    return r.stdout


def compare(a, b):
    """(normwise relative error, max abs difference) of a against the reference b."""
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)), float(np.abs(a - b).max())


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits[0].float().numpy()


def our_logits(megatron, ck, tokens, device, path):
    run([megatron, "logits", "--load", ck, "--token-ids", " ".join(map(str, tokens[0].tolist())), "--output", path,
         "--device", device])
    return np.fromfile(path, dtype=np.float32).reshape(tokens.shape[1], VOCAB)


def inject_mtp(hf_dir, cfg, gen):
    """Adds DeepSeek's MTP layer model.layers.<L> to model.safetensors: the last decoder layer's
    tensor names with fresh random values, enorm / hnorm / eh_proj / shared_head.norm, and the
    copies of the embedding and the output layer DeepSeek stores. Returns the injected tensors."""
    path = os.path.join(hf_dir, "model.safetensors")
    assert os.path.exists(path), "expected one model.safetensors (the model is small)"
    t = load_file(path)
    L, h = cfg.num_hidden_layers, cfg.hidden_size
    src, dst = f"model.layers.{L - 1}.", f"model.layers.{L}."
    mtp = {}
    for name, v in t.items():
        if not name.startswith(src):
            continue
        new = dst + name[len(src):]
        if new.endswith("e_score_correction_bias"):
            mtp[new] = torch.rand(v.shape, generator=gen)
        elif "norm" in new and v.dim() == 1:
            mtp[new] = 1.0 + 0.2 * torch.randn(v.shape, generator=gen)
        elif new.endswith("mlp.gate.weight"):
            mtp[new] = torch.randn(v.shape, generator=gen)
        else:
            mtp[new] = 0.1 * torch.randn(v.shape, generator=gen)
    for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        mtp[dst + n] = 1.0 + 0.2 * torch.randn(h, generator=gen)
    mtp[dst + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=gen)
    mtp[dst + "embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
    mtp[dst + "shared_head.head.weight"] = t["model.embed_tokens.weight" if cfg.tie_word_embeddings
                                             else "lm_head.weight"].clone()
    mtp = {k: v.float().contiguous() for k, v in mtp.items()}
    t = {k: v.clone() for k, v in t.items()}  # no views of the file being replaced
    t.update(mtp)
    save_file(t, path + ".tmp", metadata={"format": "pt"})
    os.replace(path + ".tmp", path)
    return mtp


def per_expert(tensors):
    """transformers 5's fused expert tensors (experts.gate_up_proj [E, 2f, h], experts.down_proj
    [E, h, f]) as the per-expert names export-hf writes."""
    out = {}
    for name, v in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            p, f = name[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{p}{e}.gate_proj.weight"], out[f"{p}{e}.up_proj.weight"] = v[e, :f], v[e, f:]
        elif name.endswith("experts.down_proj"):
            p = name[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = v[e]
        else:
            out[name] = v
    return out


def exported_tensors(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("megatron")
    ap.add_argument("workdir")
    ap.add_argument("--devices", nargs="+", default=["cpu", "cuda"])
    ap.add_argument("--families", nargs="+", default=["v3", "v2"], choices=["v3", "v2"])
    ap.add_argument("--labels", nargs="+", default=None, choices=[x for v in LABELS.values() for x in v],
                    help="only these configurations (of the chosen families)")
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (1, TOKENS), generator=gen)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    results = []

    def check(what, err, tol, extra=""):
        rel, mx = err
        ok = rel < tol
        results.append(ok)
        print(f"  {what:58s} rel {rel:.2e}  max|diff| {mx:.2e}  (tol {tol:g}) {extra}{'PASS' if ok else 'FAIL'}")

    labels = [label for family in args.families for label in LABELS[family]
              if args.labels is None or label in args.labels]
    if not labels:
        raise SystemExit(f"no configuration selected: --labels {args.labels} not in --families {args.families}")
    for label in labels:
        cfg = config(label)
        arch = transformers.DeepseekV2ForCausalLM if label.startswith("dsv2") else transformers.DeepseekV3ForCausalLM
        cfg.architectures = [arch.__name__]
        model = arch(cfg).float().eval()
        randomize(model, gen)
        model.tie_weights()
        margin = (RoutingMarginV2 if label.startswith("dsv2") else RoutingMargin)(model)
        ref = hf_logits(model, tokens)
        hf_dir = os.path.join(args.workdir, label)
        model.save_pretrained(hf_dir, safe_serialization=True)
        mtp = inject_mtp(hf_dir, cfg, gen) if getattr(cfg, "num_nextn_predict_layers", 0) else {}
        note = v2_softmax_note(model, cfg) if label.startswith("dsv2") else ""
        print(f"{label}: routing margin {margin.margin:.2e}, {len(mtp)} MTP tensors injected{note}")
        ck = os.path.join(args.workdir, label + "_ckpt")
        log = run([args.megatron, "import-hf", "--hf-dir", hf_dir, "--save", ck])
        if mtp:  # the model summary of the import log names the MTP depth
            results.append("multi-token prediction: 1 depth(s)" in log)
            print(f"  import: the checkpoint has the MTP layer: {'PASS' if results[-1] else 'FAIL'}")
        for dev in args.devices:
            try:
                ours = our_logits(args.megatron, ck, tokens, dev, os.path.join(args.workdir, f"{label}_{dev}.bin"))
            except SystemExit as e:  # one device failing does not hide the others' results
                print(f"  import: megatron logits --device {dev} failed: {e}  FAIL")
                results.append(False)
                continue
            check(f"import: megatron.cpp ({dev}) vs transformers logits", compare(ours, ref), 1e-4)
        exp = os.path.join(args.workdir, label + "_export")
        run([args.megatron, "export-hf", "--load", ck, "--hf-dir", exp, "--hf-dtype", "fp32", "--max-shard-size",
             "200000"])
        back = arch.from_pretrained(exp, torch_dtype=torch.float32).eval()
        check("export: transformers(exported) vs transformers(original)", compare(hf_logits(back, tokens), ref), 1e-6)
        if mtp:
            got = exported_tensors(exp)
            want = per_expert(mtp)
            same = all(n in got and torch.equal(got[n], v) for n, v in want.items())
            results.append(same)
            print(f"  export: {len(want)} MTP tensors bitwise equal to the injected ones: {'PASS' if same else 'FAIL'}")
        if label != LABELS["v3"][0]:
            continue
        ck2 = os.path.join(args.workdir, label + "_trained")
        run([args.megatron, "pretrain", "--use-checkpoint-args", "--finetune", "--mock-data", "--tokenizer-type",
             "NullTokenizer", "--vocab-size", str(VOCAB), "--seq-length", "32", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--moe-router-bias-update-rate", "0.01",
             "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1", "--device", "cpu", "--no-progress",
             "--load", ck, "--save", ck2])
        exp2 = os.path.join(args.workdir, label + "_trained_export")
        run([args.megatron, "export-hf", "--load", ck2, "--hf-dir", exp2, "--hf-dtype", "fp32"])
        trained = transformers.DeepseekV3ForCausalLM.from_pretrained(exp2, torch_dtype=torch.float32).eval()
        margin2 = RoutingMargin(trained)
        theirs = hf_logits(trained, tokens)
        ours = our_logits(args.megatron, ck2, tokens, "cpu", os.path.join(args.workdir, f"{label}_trained.bin"))
        moved = float(np.abs(theirs - ref).max())
        check("trained: megatron.cpp (cpu) vs transformers(exported)", compare(ours, theirs), 1e-4,
              f"[logits moved {moved:.2e} in training, margin {margin2.margin:.1e}] ")
    print("PASS" if all(results) else "FAIL")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()

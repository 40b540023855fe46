"""One prepared check of the NVFP4 export on a GPU machine (not part of the test suite).

    PYTHONPATH=. python scripts/gpu_nvfp4_check.py [--out /tmp/nvfp4_gpu] [--vllm]

1. builds a small Qwen3-MoE from a config (random weights, lab tokenizer; no downloads) and saves it;
2. exports it (W4A16 and W4A4) with ``export_policy`` on the CPU;
3. re-quantizes every Linear weight on the GPU and checks the bytes equal the CPU export's, and,
   where compressed-tensors is installed, equal its compressor's on the GPU (Triton when available);
   throughput GB/s of bf16 weights in, ours vs compressed-tensors, same tensors, same run;
4. loads the export dequantized on the GPU (fp32 and bf16) and checks the weights bit for bit against
   ``dequantize_nvfp4`` of the stored tensors;
5. forward pass on the GPU: fp32 checkpoint vs dequantized export (mean |log p diff|, max |logit diff|),
   and GPU vs CPU for the same dequantized export; LocalEngine generate/score on the GPU;
6. with ``--vllm`` and vllm installed: vLLM loads the export and generates (its NVFP4 kernels).

Prints every figure; exits 1 if any bit-exactness check fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

FAIL: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        FAIL.append(what)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_checkpoint(out: Path) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from prodrl_pipelines.lab.tokenizer import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=True,
                         pad_token_id=int(tok.pad_token_id), eos_token_id=int(tok.eos_token_id))
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).float()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"built Qwen3-MoE checkpoint: {n / 1e6:.1f}M parameters at {out}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/nvfp4_gpu")
    ap.add_argument("--vllm", action="store_true", help="also load the export with vLLM (slow start)")
    ap.add_argument("--device", default="cuda", help="'cpu' for a dry run of the script itself")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this script is for a GPU machine (--device cpu for a dry run)")
        return 2
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0) if dev.type == 'cuda' else dev}")
    from safetensors.torch import load_file

    from prodrl_pipelines.engines.local import LocalEngine
    from prodrl_pipelines.engines.types import SamplingParams
    from prodrl_pipelines.quant import nvfp4
    from prodrl_pipelines.quant.export import export_policy

    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ckpt = build_checkpoint(root / "ckpt")

    # 2. CPU export
    print("\n[2] export on the CPU")
    t0 = time.perf_counter()
    rep = export_policy(ckpt, root / "w4a16", "nvfp4-w4a16")
    print(f"  W4A16: {time.perf_counter() - t0:.1f}s, {rep['export_bytes'] / 1e6:.1f} MB, "
          f"{rep['compression_ratio']:.2f}x vs bf16, rel. Frobenius error mean {rep['mean_rel_fro_error']:.4f} "
          f"max {rep['max_rel_fro_error']:.4f}")
    tok = LocalEngine.from_pretrained(ckpt).tokenizer
    prompts = [tok.encode(f"<|im_start|>user\n{a}+{b}=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
               for a, b in [(3, 4), (12, 30), (7, 8), (99, 1)]]
    rep4 = export_policy(ckpt, root / "w4a4", "nvfp4-w4a4", calibration_prompts=prompts)
    print(f"  W4A4: {rep4['export_bytes'] / 1e6:.1f} MB with input_global_scale from {len(prompts)} prompts")

    # 3. GPU quantization == CPU export == compressed-tensors
    print("\n[3] quantization on the GPU")
    src = load_file(ckpt / "model.safetensors")
    exp = load_file(root / "w4a16" / "model.safetensors")
    names = [k for k, t in src.items() if nvfp4.quantizable(k, t)]
    same = True
    for k in names:
        p = k[: -len(".weight")]
        q = nvfp4.quantize_nvfp4(src[k].to(dev), exp[f"{p}.weight_global_scale"].to(dev), name=k)
        same &= torch.equal(q.packed.cpu(), exp[f"{p}.weight_packed"])
        same &= torch.equal(q.scale.cpu().view(torch.uint8), exp[f"{p}.weight_scale"].view(torch.uint8))
    check(same, f"GPU quantize_nvfp4 bytes == CPU export bytes ({len(names)} tensors)")
    weights = [src[k].to(dev, torch.bfloat16) for k in names]
    gb = sum(w.numel() * 2 for w in weights) / 1e9

    def run_ours():
        return [nvfp4.quantize_nvfp4(w) for w in weights]

    def timeit(fn, reps=5):
        fn()
        sync()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[reps // 2]

    t_ours = timeit(run_ours)
    print(f"  ours: {gb / t_ours:.3f} GB/s of bf16 weights in ({gb * 1e3:.0f} MB)")
    try:
        from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
        from compressed_tensors.quantization import preset_name_to_scheme
        from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

        scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])

        def ct(w):
            g = generate_gparam(w.amin(), w.amax())
            grp = w.unflatten(-1, (w.shape[1] // 16, 16))
            s, zp = calculate_qparams(grp.amin(-1), grp.amax(-1), scheme.weights, global_scale=g)
            return NVFP4PackedCompressor.compress({"weight": w, "weight_scale": s, "weight_global_scale": g,
                                                   "weight_zero_point": zp}, scheme)

        ours = run_ours()
        eq = all(torch.equal(o.packed, c["weight_packed"]) and torch.equal(o.scale.view(torch.uint8),
                 c["weight_scale"].view(torch.uint8)) and torch.equal(o.global_scale, c["weight_global_scale"])
                 for o, c in zip(ours, (ct(w) for w in weights)))
        check(eq, "GPU bytes == compressed-tensors' compressor on the GPU (bf16 weights)")
        t_ct = timeit(lambda: [ct(w) for w in weights])
        print(f"  compressed-tensors: {gb / t_ct:.3f} GB/s; ratio ours / compressed-tensors = {t_ct / t_ours:.2f}x")
    except ImportError as e:
        print(f"  compressed-tensors not installed ({e}): skipped the library comparison")

    # 3b. throughput where it matters: large bf16 weights (launch overhead amortised)
    big_n = 8192 if dev.type == "cuda" else 512
    gen = torch.Generator(device=dev).manual_seed(0)
    big = [torch.randn(big_n, big_n, device=dev, generator=gen).to(torch.bfloat16) * 0.02 for _ in range(4)]
    gb_big = sum(w.numel() * 2 for w in big) / 1e9
    t_big = timeit(lambda: [nvfp4.quantize_nvfp4(w) for w in big])
    line = f"  large weights (4 x {big_n}x{big_n} bf16, {gb_big * 1e3:.0f} MB): ours {gb_big / t_big:.2f} GB/s"
    try:
        t_big_ct = timeit(lambda: [ct(w) for w in big])
        outs_o, outs_c = [nvfp4.quantize_nvfp4(w) for w in big[:1]], [ct(w) for w in big[:1]]
        check(torch.equal(outs_o[0].packed, outs_c[0]["weight_packed"]), "large-weight bytes == compressed-tensors'")
        line += f", compressed-tensors {gb_big / t_big_ct:.2f} GB/s, ratio {t_big_ct / t_big:.2f}x"
    except NameError:
        pass
    print(line)
    big = None  # frees the device memory (the lambdas above hold the name, not the list)

    # 4. loading dequantized on the GPU
    print("\n[4] load the export dequantized on the GPU")
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = nvfp4.load_nvfp4_model(root / "w4a16", dtype=dtype, device=dev)
        msd = model.state_dict()
        ok = True
        for k in names:
            p = k[: -len(".weight")]
            if ".experts." in p:
                continue  # fused on load: checked below
            want = nvfp4.dequantize_nvfp4(exp[f"{p}.weight_packed"].to(dev), exp[f"{p}.weight_scale"].to(dev),
                                          exp[f"{p}.weight_global_scale"].to(dev), dtype)
            ok &= torch.equal(msd[k], want)
        ex = "model.layers.0.mlp.experts"
        gate = nvfp4.dequantize_nvfp4(exp[f"{ex}.5.gate_proj.weight_packed"].to(dev),
                                      exp[f"{ex}.5.gate_proj.weight_scale"].to(dev),
                                      exp[f"{ex}.5.gate_proj.weight_global_scale"].to(dev), dtype)
        ok &= torch.equal(msd[f"{ex}.gate_up_proj"][5, : gate.shape[0]], gate)
        check(ok, f"loaded {dtype} weights == dequantize_nvfp4 on the GPU (incl. a fused expert)")
        del model

    # 5. forward passes
    print("\n[5] forward pass")
    ids = torch.tensor([sum(prompts, [])[:64]], device=dev)
    ref = LocalEngine.from_pretrained(ckpt, device=dev, dtype=torch.float32).model
    with torch.inference_mode():
        lp_ref = torch.log_softmax(ref(input_ids=ids).logits.float(), -1)
        for dtype in (torch.float32, torch.bfloat16):
            m, _ = nvfp4.load_nvfp4_model(root / "w4a16", dtype=dtype, device=dev)
            logits = m(input_ids=ids).logits.float()
            lp = torch.log_softmax(logits, -1)
            kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item()
            print(f"  export ({dtype}) vs fp32 checkpoint on GPU: mean |log p diff| {(lp - lp_ref).abs().mean():.4f}, "
                  f"KL(ckpt || export) {kl:.5f}")
        m_cpu, _ = nvfp4.load_nvfp4_model(root / "w4a16", dtype=torch.float32)
        m_gpu, _ = nvfp4.load_nvfp4_model(root / "w4a16", dtype=torch.float32, device=dev)
        lc = m_cpu(input_ids=ids.cpu()).logits
        lg = m_gpu(input_ids=ids).logits.cpu()
        print(f"  same fp32 export, GPU vs CPU: max |logit diff| {(lc - lg).abs().max():.2e}")
    eng = LocalEngine.from_pretrained(root / "w4a16", device=dev)
    params = SamplingParams(temperature=1.0, max_tokens=8, num_top_logprobs=5)
    recs = eng.generate(prompts, params, seed=0)
    scored = eng.score(prompts, [r.output_token_ids for r in recs], params)
    d = max(abs(a - b) for r, s in zip(recs, scored) for a, b in zip(r.output_logprobs, s))
    print(f"  LocalEngine on the GPU: {sum(len(r.output_token_ids) for r in recs)} tokens, "
          f"max |recorded - rescored logprob| {d:.2e}")

    # 6. vLLM
    if args.vllm:
        print("\n[6] vLLM")
        try:
            from vllm import LLM
            from vllm import SamplingParams as VSP

            llm = LLM(model=str(root / "w4a16"), max_model_len=256, gpu_memory_utilization=0.3, enforce_eager=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], VSP(max_tokens=8, logprobs=1))
            print(f"  vLLM generated: {[o.outputs[0].token_ids for o in outs]}")
            check(True, "vLLM loads and serves the export")
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            check(False, "vLLM loads and serves the export")

    print("\nsummary:", json.dumps({"failures": FAIL}))
    return 1 if FAIL else 0


if __name__ == "__main__":
    sys.exit(main())

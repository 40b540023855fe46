"""NVFP4 export throughput: our quantizer vs compressed-tensors' own pipeline on the same bf16 tensors,
measured interleaved in one run (GB/s of bf16 weights in; target ratio >= 1, identical bytes); and the
whole export's peak memory at a real vocabulary.

Both sides do the whole job from a bf16 weight to the stored tensors: global scale, FP8 block
scales, FP4 codes, packing. compressed-tensors: ``generate_gparam`` -> ``calculate_qparams`` ->
``NVFP4PackedCompressor.compress`` (its CPU path; its Triton kernels need a GPU). Ours:
``quantize_nvfp4``. The bytes (packed codes, FP8 scales, global scale) are asserted identical.

Peak memory: a Qwen3 with Qwen's real vocabulary (151,936 rows, untied embedding and output matrix,
~79M parameters, a ~316 MB fp32 checkpoint) exported to NVFP4 W4A16 by ``export_policy`` in a fresh
process; the peak resident memory the export adds (``phases.PhaseMeter`` resets the high-water mark
after the imports) over the checkpoint's size (goal <= 1.3).

Last line: ``nvfp4_export: throughput ours/compressed-tensors=X; peak-memory/checkpoint=X``.

Usage: ``python bench/nvfp4_export.py [--vocab 151936] [--repeats 5] [--smoke]``

Smoke size (``--smoke``, bench/_smoke.py): two of the layer's tensors, one repeat, vocabulary 4,096.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _smoke import parse_args  # noqa: E402

from prodrl_pipelines.quant.nvfp4 import quantize_nvfp4  # noqa: E402

SCHEME = preset_name_to_scheme("NVFP4A16", ["Linear"])
# One Qwen3-0.6B-sized decoder layer's Linear shapes ([out, in]): q, k, v, o, gate, up, down.
SHAPES = [(2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (3072, 1024), (1024, 3072)]
REPS = 5


def theirs(w):
    g = generate_gparam(w.amin(), w.amax())
    groups = w.unflatten(-1, (w.shape[1] // 16, 16))
    s, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), SCHEME.weights, global_scale=g)
    out = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": s, "weight_global_scale": g,
                                          "weight_zero_point": zp}, SCHEME)
    return out["weight_packed"], out["weight_scale"], out["weight_global_scale"]


def ours(w):
    q = quantize_nvfp4(w)
    return q.packed, q.scale, q.global_scale


def write_checkpoint(path: Path, vocab: int) -> int:
    """A ~79M-parameter Qwen3 (vocabulary ``vocab``, untied) saved as an fp32 trainer checkpoint."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prodrl_pipelines.lab.tokenizer import build_tokenizer

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).float().save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def memory_child(src: str, dst: str) -> None:
    from prodrl_pipelines.loop.phases import PhaseMeter
    from prodrl_pipelines.quant.export import export_policy

    meter = PhaseMeter()  # resets the peak RSS: counts what the export adds
    with meter.phase("export"):
        export_policy(src, dst)
    p = meter.phases["export"]
    print(json.dumps({"peak_added": p["added_peak_mb"] * 1e6, "seconds": p["seconds"]}))


def peak_memory(vocab: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        ckpt = Path(d) / "ckpt"
        size = write_checkpoint(ckpt, vocab)
        r = subprocess.run([sys.executable, __file__, "--memory-child", str(ckpt), str(Path(d) / "export")],
                           capture_output=True, text=True, check=True)
        m = json.loads(r.stdout.strip().splitlines()[-1])
    ratio = m["peak_added"] / size
    print(f"export of a {size / 1e6:.0f} MB checkpoint (vocabulary {vocab:,}): peak memory added "
          f"{m['peak_added'] / 1e6:.0f} MB = {ratio:.2f}x the checkpoint (goal <= 1.3), {m['seconds']:.1f} s")
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--repeats", type=int, default=REPS)
    ap.add_argument("--tensors", type=int, default=len(SHAPES), help="how many of the layer's tensors (SHAPES)")
    ap.add_argument("--memory-child", nargs=2)
    args = parse_args(ap, vocab=4096, repeats=1, tensors=2)
    if args.memory_child:
        memory_child(*args.memory_child)
        return
    torch.manual_seed(0)
    weights = [(torch.randn(n, k) * 0.02).to(torch.bfloat16) for n, k in SHAPES[: args.tensors]]
    gb = sum(w.numel() * 2 for w in weights) / 1e9
    # identical bytes first
    for w in weights:
        a, b = ours(w), theirs(w)
        assert torch.equal(a[0], b[0]), "packed codes differ"
        assert torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8)), "FP8 scales differ"
        assert torch.equal(a[2], b[2]), "global scales differ"
    times = {"ours": [], "compressed-tensors": []}
    for _ in range(args.repeats):  # interleaved, so load on the shared machine hits both alike
        for name, fn in (("ours", ours), ("compressed-tensors", theirs)):
            t0 = time.perf_counter()
            for w in weights:
                fn(w)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{len(weights)} bf16 tensors, {gb * 1e3:.1f} MB in, torch threads {torch.get_num_threads()}, "
          f"median of {args.repeats}; bytes identical")
    for k, t in med.items():
        print(f"  {k:20s} {t * 1e3:8.1f} ms  {gb / t:6.3f} GB/s")
    ratio = med["compressed-tensors"] / med["ours"]
    print(f"throughput ratio ours / compressed-tensors = {ratio:.2f}x (target >= 1)")
    mem = peak_memory(args.vocab)
    print(f"nvfp4_export: throughput ours/compressed-tensors={ratio:.2f}; peak-memory/checkpoint={mem:.2f}")


if __name__ == "__main__":
    main()

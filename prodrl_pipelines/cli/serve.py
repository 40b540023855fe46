"""``prodrl serve``: the command line of the local engine server."""

from __future__ import annotations

import argparse
import os

from prodrl_pipelines.engines.reply_parsers import TOOL_FORMATS
from prodrl_pipelines.engines.server import KEEP_ALIVE_S, build_app
from prodrl_pipelines.engines.server import __doc__ as server_doc
from prodrl_pipelines.engines.serve_state import load_engine


def add_serve_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="serve a checkpoint with vLLM's OpenAI-compatible API (local engine)",
                       description=server_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model_dir", help="HF checkpoint directory (model + tokenizer), e.g. an export")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="model name in the API (default: model_dir)")
    s.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs/top_logprobs allowed (vLLM: 20)")
    s.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"), help="require this bearer token on /v1")
    s.add_argument("--max-body-bytes", type=int, default=None, help="refuse larger requests with a 413 (default 8 MiB)")
    s.add_argument("--batch-wait-ms", type=float, default=10.0,
                   help="longest wait to fill a batch (it closes earlier after 1 ms without a new request)")
    s.add_argument("--batch-quiet-ms", type=float, default=1.0,
                   help="close a batch after this long without a new request")
    s.add_argument("--max-batch-size", type=int, default=64, help="most prompts per engine call")
    s.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto: sampling defaults from generation_config.json (as vLLM); vllm: ignore them")
    s.add_argument("--device", default="cpu")
    s.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: tiny models on shared CPUs were measured ~10x "
                        "slower with 2 OpenMP threads; 0 keeps torch's default)")
    s.add_argument("--timeout-keep-alive", type=int, default=KEEP_ALIVE_S,
                   help="seconds an idle keep-alive connection stays open (above the clients' reuse window)")
    s.add_argument("--log-level", default="warning")
    s.add_argument("--enable-return-routed-experts", action="store_true",
                   help="MoE: every choice carries the experts of its forwarded positions, as vLLM's flag")
    s.add_argument("--reply-parser", choices=["none", *sorted(TOOL_FORMATS)], default="none",
                   help="the model's reasoning and tool-call format (vLLM's --reasoning-parser and "
                        "--tool-call-parser): replies are parsed into reasoning and tool_calls, and "
                        "tool_choice auto / required / a named function are served; none: plain replies")
    s.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters by name, as vLLM: --lora-modules, POST /v1/load_lora_adapter and "
                        "/v1/unload_lora_adapter (each adapter folded into a copy of the base)")
    s.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters (PEFT directories) served from the start under NAME")
    s.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="json: the server's log lines as JSON objects (the recorder's request-log shape)")
    s.set_defaults(fn=cmd_serve)
    return s


def cmd_serve(args) -> int:
    import uvicorn

    from prodrl_pipelines.observability.json_logs import log_config_kwargs

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine = load_engine(args.model_dir, args.device)
    app = build_app(engine, model_dir=args.model_dir, served_model_name=args.served_model_name,
                    max_logprobs=args.max_logprobs, api_key=args.api_key, batch_wait_ms=args.batch_wait_ms,
                    max_batch_size=args.max_batch_size, generation_config=args.generation_config, device=args.device,
                    batch_quiet_ms=args.batch_quiet_ms, max_body_bytes=args.max_body_bytes,
                    return_routed_experts=args.enable_return_routed_experts, reply_parser=args.reply_parser,
                    enable_lora=args.enable_lora, lora_modules=args.lora_modules)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_keep_alive=args.timeout_keep_alive, **log_config_kwargs(args.log_format, "serve"))
    return 0

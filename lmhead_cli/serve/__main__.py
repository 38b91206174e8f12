"""`python -m lmhead_cli.serve --model SOURCE [--port N] ...`: the server without the CLI around it."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from lmhead_cli.errors import LmheadError
    from lmhead_cli.serve import DEFAULT_HOST, DEFAULT_PORT, Options, check, serve

    p = argparse.ArgumentParser(prog="python -m lmhead_cli.serve")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--api-key")
    p.add_argument("--max-logprobs", type=int)
    p.add_argument("--max-queue", type=int, default=1024)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-body", type=int, default=8 * 2**20)
    p.add_argument("--cors", action="append", default=[])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--engine", default="auto")
    p.add_argument("--threads", type=int)
    a = p.parse_args(argv)
    from lmhead_cli.engine import threads

    threads.prepare(a.threads)  # before torch is imported: OpenMP's threads sleep between products
    options = Options(model=a.model, host=a.host, port=a.port, api_key=a.api_key, max_logprobs=a.max_logprobs,
                      max_queue=a.max_queue, max_batch=a.max_batch, max_body=a.max_body, cors=tuple(a.cors),
                      device=a.device, dtype=a.dtype, engine=a.engine, threads=a.threads)
    try:
        for line in check(options):
            print(f"lmhead: warning: {line}", file=sys.stderr)
        from lmhead_cli.loading.sources import load_model

        loaded = load_model(a.model, device=a.device, dtype=a.dtype, engine=a.engine, threads=a.threads)
    except LmheadError as e:
        print(f"lmhead: error: {e}", file=sys.stderr)
        return e.exit_code
    serve(options, loaded)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One request body for the OpenAI completions API, shared by loadtest.serve and the locustfile."""
from __future__ import annotations


def build_request(model: str, row: dict, args, stream: bool = True) -> dict:
    """row: one prompt-set entry {"prompt": ..., "prediction"?: ...}."""
    body = {"model": model, "prompt": row["prompt"], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "stream": stream}
    if row.get("user"):
        body["user"] = row["user"]         # the suffix method shares its cache per user
    if stream:
        body["stream_options"] = {"include_usage": True}
    extra = {}
    if args.method and args.method != "off":
        extra["speculation"] = {"method": args.method,
                                "num_speculative_tokens": 0 if args.method == "none" else args.k}
        if getattr(args, "fixed_k", False):      # draft every k asked for: the server's goodput policy off
            extra["speculation"]["adaptive"] = False
    if args.method == "prediction" and row.get("prediction"):
        extra["prediction"] = {"type": "content", "content": row["prediction"]}
    if getattr(args, "ignore_eos", False):
        extra["ignore_eos"] = True
    if extra:
        body["extra_body"] = extra
    return body

"""`seqserve`: command-line client.

    seqserve generate "Once upon a time" --max-new-tokens 50
    seqserve info
    seqserve chat                  # over the OpenAI-compatible API (--openai-url)
    seqserve workers list          # the scheduler's pool; also register ADDR, drain ADDR
    SEQSERVE_TOKEN=... seqserve --address host:8000 --tls-ca-file ca.pem info
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from client.api import Client


def _client(args) -> Client:
    try:
        return Client(args.address, tls_ca_file=args.tls_ca_file, token=args.token or None,
                      tls_cert_file=args.tls_cert_file, tls_key_file=args.tls_key_file)
    except (OSError, ValueError) as exc:  # an unreadable TLS file, a cert without its key
        raise SystemExit(f"seqserve: {exc}") from None


def _generate(args) -> int:
    params = dict(max_new_tokens=args.max_new_tokens, decoding_strategy=args.strategy,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  seed=args.seed, stop=args.stop or None, cached_prompt=args.cached_prompt)
    with _client(args) as client:
        last = None
        for chunk in client.stream(args.prompt, **params):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
    sys.stdout.write("\n")
    if last is not None and args.verbose:
        sys.stderr.write(f"[finish_reason={last.finish_reason} prompt_tokens={last.prompt_tokens}"
                         f" generated_tokens={last.generated_tokens}]\n")
    return 0


def _info(args) -> int:
    with _client(args) as client:
        sys.stdout.write(str(client.model_info()))
    return 0


def _chat(args) -> int:
    """Read a line, stream the assistant's reply, keep the conversation; /exit or EOF quits."""
    import openai

    client = openai.OpenAI(base_url=args.openai_url, api_key=args.token or "none",
                           max_retries=0, timeout=args.timeout)
    try:
        model = args.model or client.models.list().data[0].id
    except openai.APIError as exc:
        sys.stderr.write(f"seqserve: {args.openai_url}: {_api_error(exc)}\n")
        return 1
    history = [{"role": "system", "content": args.system}] if args.system else []
    options = {k: v for k, v in (("max_tokens", args.max_tokens), ("seed", args.seed),
                                 ("temperature", args.temperature)) if v is not None}
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("you> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        reply, usage, finish = [], None, None
        try:
            stream = client.chat.completions.create(
                model=model, messages=history, stream=True,
                stream_options={"include_usage": True}, **options)
            for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
                    if choice.delta.content:
                        reply.append(choice.delta.content)
                        sys.stdout.write(choice.delta.content)
                        sys.stdout.flush()
        except openai.APIConnectionError as exc:
            sys.stderr.write(f"seqserve: {args.openai_url}: {exc}\n")
            return 1
        except openai.APIError as exc:
            history.pop()  # the server refused it: the turn did not happen
            sys.stderr.write(f"seqserve: {_api_error(exc)}\n")
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": "".join(reply)})
        if args.verbose and usage is not None:
            sys.stderr.write(f"[finish_reason={finish} prompt_tokens={usage.prompt_tokens} "
                             f"completion_tokens={usage.completion_tokens}]\n")


def _workers(args) -> int:
    from client.admin import AdminClient, read_control_token

    try:
        admin = AdminClient(args.address, read_control_token(args.control_token_file),
                            tls_ca_file=args.tls_ca_file, tls_cert_file=args.tls_cert_file,
                            tls_key_file=args.tls_key_file, token=args.token or None)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"seqserve: {exc}") from None
    with admin:
        if args.action == "list":
            rows = admin.list()
        elif args.action == "register":
            rows = [admin.register(args.worker)]
        else:
            rows = [admin.drain(args.worker, wait=args.wait)]
    for w in rows:
        sys.stdout.write(f"{w.address}\t{w.state}\trunning={w.running}\twaiting={w.waiting}"
                         f"\tkv_tokens={w.kv_capacity_tokens}\n")
    return 0


def _api_error(exc) -> str:
    status = getattr(exc, "status_code", None)
    body = exc.body if isinstance(getattr(exc, "body", None), dict) else {}
    message = body.get("message") or str(exc)
    return f"{status}: {message}" if status else message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="seqserve", description="seqserve client")
    parser.add_argument("--address", default=os.environ.get("SEQSERVE_ADDRESS", "127.0.0.1:8000"),
                        help="scheduler host:port (default $SEQSERVE_ADDRESS or 127.0.0.1:8000)")
    parser.add_argument("--tls-ca-file", default=os.environ.get("SEQSERVE_TLS_CA_FILE") or None,
                        metavar="PEM", help="connect over TLS trusting this CA "
                        "(default $SEQSERVE_TLS_CA_FILE; plaintext when unset)")
    parser.add_argument("--tls-cert-file", default=os.environ.get("SEQSERVE_TLS_CERT_FILE") or None,
                        metavar="PEM", help="client certificate, for servers that require one "
                        "(default $SEQSERVE_TLS_CERT_FILE)")
    parser.add_argument("--tls-key-file", default=os.environ.get("SEQSERVE_TLS_KEY_FILE") or None,
                        metavar="PEM", help="private key of --tls-cert-file "
                        "(default $SEQSERVE_TLS_KEY_FILE)")
    parser.add_argument("--token", default=os.environ.get("SEQSERVE_TOKEN") or None,
                        help="bearer token for servers that require one (default "
                        "$SEQSERVE_TOKEN; prefer the variable: flags show in `ps`)")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a generation to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=None)
    gen.add_argument("--strategy", choices=("greedy", "sample", "contrastive"), default=None)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--cached-prompt", default="")
    gen.add_argument("-v", "--verbose", action="store_true", help="print finish reason and counts")
    gen.set_defaults(func=_generate)
    info = sub.add_parser("info", help="show the served model and limits")
    info.set_defaults(func=_info)
    chat = sub.add_parser("chat", help="chat with the model over the OpenAI-compatible API "
                          "(/exit or end of input quits)")
    chat.add_argument("--openai-url", default=os.environ.get("SEQSERVE_OPENAI_URL",
                                                             "http://127.0.0.1:8081/v1"),
                      help="base URL of the OpenAI-compatible API (default "
                      "$SEQSERVE_OPENAI_URL or http://127.0.0.1:8081/v1)")
    chat.add_argument("--model", help="model name (default: the one the server lists)")
    chat.add_argument("--system", help="a system message to start the conversation with")
    chat.add_argument("--max-tokens", type=int, default=None)
    chat.add_argument("--temperature", type=float, default=None)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--timeout", type=float, default=600.0, help="seconds per reply")
    chat.add_argument("-v", "--verbose", action="store_true",
                      help="print finish reason and token counts after each reply")
    chat.set_defaults(func=_chat)
    wk = sub.add_parser("workers", help="list, register or drain the scheduler's workers "
                        "(needs the control-plane token)")
    wk.add_argument("action", choices=("list", "register", "drain"))
    wk.add_argument("worker", nargs="?", help="host:port of the worker (register, drain)")
    wk.add_argument("--wait", action="store_true", help="drain: return once it has left")
    wk.add_argument("--control-token-file", default=None, metavar="FILE",
                    help="the control-plane token (default $SEQSERVE_CONTROL_TOKEN, else "
                    "~/.cache/seqserve/control-token, the file a scheduler here writes)")
    wk.set_defaults(func=_workers)
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.command == "workers" and args.action != "list" and not args.worker:
        parser.error(f"workers {args.action} needs the worker's host:port")
    try:
        return args.func(args)
    except grpc.RpcError as exc:
        sys.stderr.write(f"seqserve: {exc.code().name}: {exc.details()}\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())

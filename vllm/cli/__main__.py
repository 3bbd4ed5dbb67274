"""``python -m vllm.cli`` runs the ``vllm-kv`` command line."""

from vllm.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())

"""The ``vllm-kv`` command line: one module per subcommand (see :mod:`vllm.cli.main`)."""

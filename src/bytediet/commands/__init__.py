"""CLI sub-commands: one module per command, each exposing ``register(subparsers)``.

``bytediet.cli`` imports every module in this package, so a new command is one new file.
A command's handler takes the parsed ``args`` and returns an exit code; a command that reports
results accepts ``--json`` and then prints exactly one JSON object on stdout.
"""

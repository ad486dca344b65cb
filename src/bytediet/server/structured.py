"""``response_format`` → one grammar mask per sequence (constrained decoding, :mod:`bytediet.engine.grammar`).

``json_object`` constrains the output to one JSON object; ``json_schema`` to a value valid under the
given schema. The tokenizer's grammar tables are built once per server, on the first request that
needs them (about 2 s for a 49k-token vocabulary), on a worker thread.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from ..engine.grammar import GrammarCompiler
from ..errors import ConfigError
from .protocol import ResponseFormat


class Grammars:
    """The server's grammar compiler, built lazily and at most once."""

    def __init__(self, info) -> None:
        self.info = info  # the engine's EngineInfo
        self._compiler: Optional[GrammarCompiler] = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                if self.info.tokenizer is None:
                    raise ConfigError(
                        "response_format: this model has no tokenizer, so its output cannot be "
                        "constrained; leave response_format out"
                    )
                self._compiler = GrammarCompiler(self.info.tokenizer, self.info.vocab_size)
            return self._compiler

    def masks_for(self, fmt: Optional[ResponseFormat]) -> Optional[Callable[[], object]]:
        """A factory of fresh per-sequence masks for ``fmt``, or None when the output is free text."""
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return self.masks(None)
        if fmt.json_schema is None or not fmt.json_schema.json_schema:
            raise ConfigError("response_format: type json_schema needs json_schema.schema (a JSON Schema object)")
        return self.masks(fmt.json_schema.json_schema)

    def masks(self, schema: Optional[dict]) -> Callable[[], object]:
        """A factory of fresh per-sequence masks for JSON matching ``schema`` (None: any JSON object)."""
        compiler = self.compiler
        compiled_check = compiler.json_mask(schema)  # compile now, so a bad schema is a 400 before queueing
        first = [compiled_check]

        def new_mask():
            return first.pop() if first else compiler.json_mask(schema)

        return new_mask

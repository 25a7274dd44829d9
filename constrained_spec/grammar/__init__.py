"""constrained_spec.grammar: grammar matchers over xgrammar (default) and outlines-core.

`TokenizerData` (once per model) + `SchemaSpec` -> `compile_spec` (cached, with a timeout) ->
`CompiledSpec.new_matcher()` -> one `Matcher` per request: fill bitmask / accept / rollback /
fork / forced (jump-forward) tokens.
"""

from .compile import CompiledSpec, clear_compile_cache, compile_cache_info, compile_spec
from .compile_worker import CompileWorkers
from .matcher import Matcher, OutlinesMatcher, XGrammarMatcher
from .tokenizer import TokenizerData

__all__ = [
    "CompiledSpec",
    "CompileWorkers",
    "Matcher",
    "OutlinesMatcher",
    "TokenizerData",
    "XGrammarMatcher",
    "clear_compile_cache",
    "compile_cache_info",
    "compile_spec",
]

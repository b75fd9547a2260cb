"""Our ops inside other training stacks, through their own extension points
(docs/integrations.md). Each stack is a submodule — :mod:`.verl`, :mod:`.trl` — imported only
when asked: nothing here imports verl or TRL, and a submodule's entry points raise ImportError
naming the missing package. :mod:`.verifiers` trains verifiers environments through the proxy,
running them in an environment of their own (:mod:`.verifiers_runner`, a standalone script)."""

"""Shared test helpers, imported as ``from tests.helpers.<module> import ...`` (no ``sys.path`` edits).

- :mod:`tests.helpers.models`: ``tiny_config`` (the one tiny-model builder: tests and the bench
  scripts), ``tiny_model``, ``build_tiny_backbone`` (a saved random Llama + chat tokenizer),
  ``random_heads``, ``random_tree``.
- :mod:`tests.helpers.tiny_workdir`: a workdir with a random backbone and random heads (export/eval).
- :mod:`tests.helpers.train_workdir`: a workdir with a random backbone and synthetic distilled data
  (train, Medusa-2), the DeepSpeed launch helpers and the kill-and-resume helper.
- :mod:`tests.helpers.training`: ``tiny_llama`` and ``batch`` for the training unit tests.
- :mod:`tests.helpers.scripts`: ``load_script`` imports a file of ``scripts/`` as a module.
- :mod:`tests.helpers.bench`: the bench scripts' GPU timing (copy bandwidth, calls queued behind a
  sleep kernel).

The repository root is on ``sys.path`` under pytest (``tests/`` is a package: pytest's rootdir
insertion) and in the bench scripts (they add it themselves), so nothing needs installing.
Nothing here downloads anything.
"""

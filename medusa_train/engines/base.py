"""The interface between the self-distillation loop and an engine that generates its replies.

:func:`medusa_train.data.regenerate.distill_records` builds each conversation turn by turn; an
engine only turns token contexts into replies. The loop hands the engine a list of
:class:`GenRequest` and one callback; the engine calls the callback as each reply finishes, and
the callback may answer with a follow-up request (the conversation's next turn, whose context
holds that reply), which the engine generates too. So an engine may batch, reorder and overlap
requests freely: the loop never waits for a whole batch, and a new engine (an OpenAI-compatible
server, say) plugs in by implementing :class:`Engine` alone.

Contract of :meth:`Engine.run`:
    * every request, and every follow-up ``on_done`` returns, gets exactly one ``on_done`` call;
    * ``new_tokens`` holds the generated ids up to and including the first end-of-turn id, or
      exactly the engine's ``max_new_tokens`` ids when the reply was cut (no end-of-turn id then).
      An engine that receives text, not ids (a chat-completions server), gives the reply's
      re-tokenisation instead (its length may then differ; engines/server.py counts it), or None
      when even the text does not survive re-tokenisation: the loop then ends that conversation;
    * ``on_done`` is called from the thread that called ``run`` (the loop keeps no locks), and
      ``run`` returns once every request and follow-up is done;
    * greedy replies depend only on the context; a sampled reply depends only on the context and
      ``GenRequest.seed``, never on which requests share a batch (the in-process engine draws
      with a generator seeded by it; a server passes it on as the request's seed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class GenRequest:
    """One reply to generate.

    Attributes:
        key: the caller's handle, returned untouched with the reply.
        context: the token ids to continue (prompt, earlier turns and template text).
        seed: sampling seed of this reply (ignored by greedy engines); None = the engine's own.
        messages: the same context as chat messages (system, user and earlier replies as text), for
            engines that take text (a chat-completions server); None where the caller has none.
    """

    key: Any
    context: list[int]
    seed: int | None = None
    messages: list[dict[str, str]] | None = None


OnDone = Callable[[GenRequest, "list[int] | None"], "GenRequest | None"]
"""``on_done(request, new_tokens)``: a finished reply (None: not exact, see above); returns a follow-up or None."""


class Engine(Protocol):
    """Generates replies for a queue of requests (the contract is in the module docstring)."""

    def run(self, requests: list[GenRequest], on_done: OnDone) -> None:
        """Generate every request and every follow-up ``on_done`` returns."""
        ...

"""How a request's generated tokens become its answer: the completion and chat completion shapes (a JSON body, or
SSE chunks `data: {chunk}` … `data: [DONE]`). The Responses API renders the same accumulated choices its own way
(responses.py subclasses ChoiceRenderer).

A renderer is one request's: Gateway.run feeds it every GenerateEvent (add, or the sse_* methods while streaming)
and asks it for the body or the stream's frames.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import numpy as np

from splitgemma.v1 import serving_pb2 as pb

from .pipeline import FINISH_REASONS, Run
from .prompt_logprobs import MIN_LOGPROB, PromptPart, best_of, echoed
from .protocol import ApiError
from .reasoning import ReasoningPlan
from .tools import ToolPlan, ToolStream, tool_message

if TYPE_CHECKING:
    from .app import Gateway


def predicted_in(prediction: list[int], ids: list[int]) -> int:
    """Tokens of `prediction` that the answer `ids` repeats in order: the length of their longest common
    subsequence, by rows of the dynamic programme in numpy (row j: cur = prefix max of max(prev, prev shifted + equal);
    O(len × len) work, ~5 ms for 1,000 × 1,000 tokens): run off the event loop (ChoiceRenderer.count_prediction)."""
    if not prediction or not ids:
        return 0
    a, b = (prediction, ids) if len(prediction) >= len(ids) else (ids, prediction)
    a = np.asarray(a, dtype=np.int64)
    row = np.zeros(len(a) + 1, dtype=np.int32)
    for t in b:
        best = np.maximum(row[1:], row[:-1] + (a == t))
        np.maximum.accumulate(best, out=row[1:])
    return int(row[-1])


def thought_fields(thought: str) -> dict:
    """A chat message's (or delta's) thought under both names clients read: `reasoning_content` (llama-server's,
    DeepSeek's, vLLM's until it renamed it) and `reasoning` (vLLM's now)."""
    return {"reasoning_content": thought, "reasoning": thought}


def sse(obj, event: str | None = None) -> str:
    """One server-sent event: `data: {json}` (and `event: name` before it when named)."""
    data = "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"
    return data if event is None else f"event: {event}\n" + data


class ChoiceRenderer:
    """Accumulates one request's choices and renders them as a chat or text completion (body or chunks)."""

    def __init__(self, gateway: "Gateway", chat: bool, n_choices: int, request_id: str, *, logprobs: bool,
                 top_logprobs: int, include_usage: bool, tools: ToolPlan | None = None,
                 reasoning: ReasoningPlan | None = None):
        self.gw = gateway
        self.chat = chat
        self.id = request_id
        self.created = int(time.time())
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.include_usage = include_usage
        self.input_tokens = 0
        self.cached_tokens = 0
        self.service_tier = "default"   # the tier the request ran in (Gateway.run), reported in chat's answers
        self.text = [""] * n_choices
        self.tokens = [0] * n_choices
        self.finish: list[str | None] = [None] * n_choices
        self.lp: list[list] = [[] for _ in range(n_choices)]
        # With tools the text is read for calls (services/gateway/tools.py); streamed, each choice by its own parser.
        self.tools = tools
        self.tool_streams: list[ToolStream] | None = [tools.stream() for _ in range(n_choices)] if tools else None
        # With a thought channel (services/gateway/reasoning.py), each choice's tokens go through its splitter first:
        # the thought apart, the answer on (to the tool parser, or as text). thought_lp marks the logprob entries
        # of the thought's tokens.
        self.reasoning = reasoning
        self.splitters = [reasoning.splitter() for _ in range(n_choices)] if reasoning else None
        self.thought = [""] * n_choices
        self.thought_lp: list[list[bool]] = [[] for _ in range(n_choices)]
        # A predicted output's ids (chat's prediction): usage says how much of it each choice's tokens repeat,
        # counted once they are all in (count_prediction, off the event loop).
        self.prediction: list[int] | None = None
        self.prediction_accepted: int | None = None
        self.ids: list[list[int]] = [[] for _ in range(n_choices)]
        # The prompt's side (services/gateway/prompt_logprobs.py): echo, prompt_logprobs, best_of.
        self.cumulative = [0.0] * n_choices  # each choice's summed token logprob, for best_of
        self.parts: dict[int, PromptPart] = {}  # choice index -> its prompt's part
        self.echo_texts: list[str] | None = None  # per prompt, with echo
        self.vllm_prompt_logprobs = False
        self.per_prompt = 1  # choices run per prompt (best_of's candidates, or n)
        self.n = 1  # choices returned per prompt

    def prompt_side(self, *, echo_texts: list[str] | None = None, vllm_prompt_logprobs: bool = False,
                    per_prompt: int = 1, n: int = 1) -> None:
        self.echo_texts = echo_texts
        self.vllm_prompt_logprobs = vllm_prompt_logprobs
        self.per_prompt, self.n = per_prompt, n

    def take_prompt_logprobs(self, runs: list[Run]) -> None:
        """After the prefills: each choice's prompt part, from the first choice of its prompt."""
        if self.echo_texts is None and not self.vllm_prompt_logprobs:
            return
        firsts = {r.spec.index: r for r in runs if r.spec.index % self.per_prompt == 0}
        for r in runs:
            p = r.spec.index // self.per_prompt
            first = firsts[p * self.per_prompt]
            self.parts[r.spec.index] = PromptPart(self.echo_texts[p] if self.echo_texts is not None else "",
                                                  r.spec.prompt_ids, list(first.prefill_result.prompt_logprobs))

    def finish_reasons(self) -> list[str]:
        return [f or "stop" for f in self.finish]

    def count_prediction(self) -> None:
        """The prediction's tokens the choices repeat, for usage (Gateway.run calls it in an offload thread once
        the choices are done)."""
        if self.prediction is not None:
            self.prediction_accepted = sum(predicted_in(self.prediction, ids) for ids in self.ids)

    def reasoning_tokens(self) -> int:
        return sum(s.tokens for s in self.splitters or ())

    def has_thought(self, index: int) -> bool:
        """The choice opened a thought block, and the request wants it back."""
        return self.splitters is not None and self.splitters[index].seen and self.reasoning.include

    def _usage(self) -> dict:
        out = sum(self.tokens)
        usage = {"prompt_tokens": self.input_tokens, "completion_tokens": out,
                 "total_tokens": self.input_tokens + out,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        details = {}
        if self.splitters is not None:
            details["reasoning_tokens"] = self.reasoning_tokens()
        if self.prediction_accepted is not None:
            # OpenAI's: the prediction's tokens that appear in the completion (here: repeated in order,
            # predicted_in), and the rest; per choice, summed.
            details["accepted_prediction_tokens"] = self.prediction_accepted
            details["rejected_prediction_tokens"] = len(self.prediction) * len(self.ids) - self.prediction_accepted
        if details:
            usage["completion_tokens_details"] = details
        return usage

    def add(self, index: int, event: pb.GenerateEvent) -> tuple[str, str, object]:
        """(answer text, thought text, logprob entries) of a choice's next event, taken into the choice."""
        finished = event.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        thought, in_thought = "", []
        if self.splitters is None:
            text = "".join(t.text for t in event.tokens)
        else:
            splitter, pieces = self.splitters[index], []
            for t in event.tokens:
                before = splitter.tokens
                pieces += splitter.push(t.token_id, t.text)
                in_thought.append(splitter.tokens > before)
            if finished:
                pieces += splitter.finish()
            text = "".join(piece for kind, piece in pieces if kind == "answer")
            if self.reasoning.include:
                thought = "".join(piece for kind, piece in pieces if kind == "thought")
        self.text[index] += text
        self.thought[index] += thought
        if self.prediction is not None:
            self.ids[index].extend(t.token_id for t in event.tokens)
        self.tokens[index] = max(self.tokens[index] + len(event.tokens), event.completion_tokens)
        if finished:
            self.finish[index] = FINISH_REASONS.get(event.finish_reason, "stop")
        self.cumulative[index] += sum(t.logprob for t in event.tokens)
        lp = self._logprobs(event.tokens) if self.logprobs else None
        if lp is not None:
            self.lp[index].extend(lp)
            self.thought_lp[index].extend(in_thought or [False] * len(lp))
        return text, thought, lp

    def _logprobs(self, tokens) -> list:
        out = []
        for t in tokens:
            text = self.gw.token_text(t.token_id)
            tops = [(self.gw.token_text(a.token_id), max(a.logprob, MIN_LOGPROB))
                    for a in t.top_logprobs[:self.top_logprobs]]
            out.append((text, max(t.logprob, MIN_LOGPROB), tops, t.text))
        return out

    def _chat_logprobs(self, entries) -> dict:
        return {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")),
                             "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode("utf-8"))}
                                              for a, alp in tops]}
                            for text, lp, tops, _ in entries], "refusal": None}

    def _text_logprobs(self, entries, offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for text, lp, alternatives, emitted in entries:
            tokens.append(text)
            token_lps.append(lp)
            tops.append(dict(alternatives) if self.top_logprobs else None)
            offsets.append(offset)
            offset += len(emitted)
        return {"tokens": tokens, "token_logprobs": token_lps,
                "top_logprobs": tops if self.top_logprobs else None, "text_offset": offsets}

    # non-streaming
    def body(self) -> dict:
        choices = []
        for i in range(len(self.text)):
            lp = None
            if self.logprobs:
                lp = self._chat_logprobs(self.lp[i]) if self.chat else self._text_logprobs(self.lp[i], 0)
            if self.chat:
                message, finish = {"role": "assistant", "content": self.text[i]}, self.finish[i] or "stop"
                if self.tools is not None:
                    message, finish = tool_message(self.tools, self.text[i], finish)
                    self.finish[i] = finish
                if self.has_thought(i):
                    message.update(thought_fields(self.thought[i]))
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
            else:
                text, part = self.text[i], self.parts.get(i)
                if self.echo_texts is not None:
                    lp = self._text_logprobs(self.lp[i], len(part.text)) if self.logprobs else None
                    text, lp = echoed(part, text, lp, self.gw.token_text, self.top_logprobs)
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": self.finish[i] or "stop"}
                if self.vllm_prompt_logprobs:
                    choice["prompt_logprobs"] = part.vllm_prompt_logprobs(self.gw.token_text)
                choices.append(choice)
        if self.per_prompt != self.n:  # best_of: the n best candidates of each prompt, numbered anew
            keep = best_of(self.cumulative, len(choices) // self.per_prompt, self.per_prompt, self.n)
            choices = [dict(choices[i], index=k) for k, i in enumerate(keep)]
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.gw.config.model_name, "choices": choices,
                "usage": self._usage()}
        if self.chat:
            body["service_tier"] = self.service_tier
        if self.chat and self.vllm_prompt_logprobs:  # vLLM: the chat response's, not a choice's
            body["prompt_logprobs"] = self.parts[0].vllm_prompt_logprobs(self.gw.token_text)
        return body

    # streaming
    def _chunk(self, choices: list[dict]) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.gw.config.model_name, "choices": choices}
        if self.chat:
            out["service_tier"] = self.service_tier
        if self.include_usage:
            out["usage"] = None
        return out

    def stream_start(self) -> list[dict]:
        if not self.chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(len(self.text))]

    def stream_event(self, index: int, event: pb.GenerateEvent) -> list[dict]:
        offset = len(self.text[index])
        text, thought, lp = self.add(index, event)
        finish = self.finish[index] if event.finish_reason != pb.FINISH_REASON_UNSPECIFIED else None
        if self.tool_streams is not None:
            return self._delta_chunks(index, self._thought_deltas(thought) + self._tool_deltas(index, text, finish),
                                      lp, self.finish[index] if finish is not None else None, separate_finish=True)
        if not text and not thought and lp is None and finish is None:
            return []  # e.g. a token whose bytes are held back until its character is complete
        if self.chat:
            deltas = self._thought_deltas(thought)
            if text or (finish is None and not thought):
                deltas.append({"content": text})
            return self._delta_chunks(index, deltas, lp, finish)
        choice = {"index": index, "text": text,
                  "logprobs": self._text_logprobs(lp, offset) if lp is not None else None, "finish_reason": finish}
        return [self._chunk([choice])]

    @staticmethod
    def _thought_deltas(thought: str) -> list[dict]:
        return [thought_fields(thought)] if thought else []

    def _tool_deltas(self, index: int, text: str, finish: str | None) -> list[dict]:
        """A choice's new text through its tool parser, as chat deltas; at its end (finish) the parser's last deltas,
        and the finish reason settled (tool_calls when a call was completed)."""
        stream = self.tool_streams[index]
        deltas = stream.push(text) if text else []
        if finish is not None:
            deltas += stream.finish()
            self.finish[index] = stream.finish_reason(finish)
        return deltas

    def _delta_chunks(self, index: int, deltas: list[dict], lp, finish: str | None, *,
                      separate_finish: bool = False) -> list[dict]:
        """One chunk per delta, the event's logprobs on the first; the finish reason on the last, or (with tools)
        on a chunk of its own."""
        if lp is not None and not deltas:
            deltas = [{}]  # the logprobs of tokens whose text is held (a marker, a call's syntax, a name line)
        if finish is not None and not separate_finish and not deltas:
            deltas = [{}]
        chunks = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1 and not separate_finish
            chunks.append(self._chunk([{"index": index, "delta": delta,
                                        "logprobs": self._chat_logprobs(lp) if lp is not None and k == 0 else None,
                                        "finish_reason": finish if last else None}]))
        if finish is not None and separate_finish:
            chunks.append(self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}]))
        return chunks

    def usage_chunk(self) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = self._usage()
        return chunk

    # the SSE frames Gateway.run streams
    def sse_start(self) -> list[str]:
        return [sse(c) for c in self.stream_start()]

    def sse_event(self, index: int, event: pb.GenerateEvent) -> list[str]:
        return [sse(c) for c in self.stream_event(index, event)]

    def sse_end(self) -> list[str]:
        return ([sse(self.usage_chunk())] if self.include_usage else []) + ["data: [DONE]\n\n"]

    def sse_error(self, e: ApiError) -> list[str]:
        return [sse(e.body())]  # then the stream closes without [DONE]: it did not complete

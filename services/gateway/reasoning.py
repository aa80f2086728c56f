"""Thinking on /v1/chat/completions and /v1/responses (docs/reasoning.md): turning Gemma 4's thinking on, holding a
constrained answer to its constraint only after the thought, and returning the thought apart from the answer.

On: `chat_template_kwargs: {"enable_thinking": true}` (vLLM's way), or OpenAI's `reasoning_effort` (chat) /
`reasoning.effort` (Responses) at any level but "none" — the model has one thinking mode, so every level turns the
same one on. A model whose template has no thinking mode refuses an effort that asks for thinking (400, as OpenAI
answers for a model without reasoning); the two ways may not disagree.

Read: whenever the model has a thought channel (splitgemma.serving.thinking), thinking on or not — a thought block in
the output is never left inside the answer. The thought is returned as `reasoning_content` and `reasoning` (chat: the
message and the stream's deltas; llama-server's and DeepSeek's field, and vLLM's new name for it) or as a reasoning
item (Responses); `include_reasoning: false` (vLLM's) drops it. Its tokens are counted in
`completion_tokens_details.reasoning_tokens` / `output_tokens_details.reasoning_tokens`, and in the token limit, as
OpenAI counts them.

Budget: vLLM's `thinking_token_budget` (Anthropic's thinking.budget_tokens on /v1/messages) bounds a thinking
request's thought: its constraint (an answer of any text when the request has none) admits at most that many tokens
between the markers, after which the close marker is the only token allowed — the decode worker takes it without
the model — and the answer follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitgemma.serving.thinking import THINKING_SWITCH, ThoughtMarkers, ThoughtSplitter
from splitgemma.serving.tokenizer import control_tokens
from splitgemma.v1 import serving_pb2 as pb

from .protocol import invalid

# The answer a budgeted thought leaves unconstrained: any text (a thinking request without a constraint of its own).
ANY_ANSWER = "start: /(?s:.*)/"

@dataclass(frozen=True)
class ReasoningFormat:
    """What the model's tokenizer and template offer: the thought channel's markers (None: the output has no
    thought to read), whether the template can turn thinking on, and the special tokens (id -> spelling), dropped
    from what a request that skips them gets back."""

    markers: ThoughtMarkers | None
    can_think: bool
    special: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, tokenizer, template_source: str) -> "ReasoningFormat":
        markers = ThoughtMarkers.from_tokenizer(tokenizer, template_source)
        return cls(markers, markers is not None and THINKING_SWITCH in template_source,
                   control_tokens(tokenizer))


def thinking(req, fmt: ReasoningFormat, effort_param: str = "reasoning_effort") -> bool:
    """Whether the request turns thinking on; a 400 naming `effort_param` when its effort asks for thinking the
    model does not have, or disagrees with chat_template_kwargs.enable_thinking."""
    effort = req.reasoning_effort
    switch = (req.chat_template_kwargs or {}).get(THINKING_SWITCH)
    asked = effort is not None and effort != "none"
    if asked and not fmt.can_think:
        raise invalid(f"{effort_param} {effort!r} asks for thinking, which this model does not do (its chat template "
                      "has no thinking mode); leave it out or send \"none\"", param=effort_param,
                      code="unsupported_parameter")
    if effort is not None and switch is not None and asked != bool(switch):
        raise invalid(f"{effort_param} {effort!r} and chat_template_kwargs.{THINKING_SWITCH} ({switch!r}) disagree",
                      param=effort_param, code="invalid_value")
    return asked or bool(switch)


def template_kwargs(req, fmt: ReasoningFormat) -> dict:
    """The chat template's extra variables: the request's chat_template_kwargs, and enable_thinking when its
    effort turns thinking on."""
    on = thinking(req, fmt)
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None and fmt.can_think:
        kwargs[THINKING_SWITCH] = on
    return kwargs


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's output is read: the markers, whether the request thinks (its constraint then admits a
    thought first), whether the thought is returned, and the special tokens dropped from each part."""

    markers: ThoughtMarkers
    thinks: bool
    include: bool
    hide_thought: dict[int, str]
    hide_answer: dict[int, str]
    budget: int | None = None   # the thought's most tokens between its markers (thinking requests)

    def splitter(self) -> ThoughtSplitter:
        return ThoughtSplitter(self.markers, self.hide_thought, self.hide_answer)

    def apply(self, specs) -> None:
        """The decode worker sends special tokens' text: text it holds back before a marker (a possible stop
        string) then comes out with the marker, and is put with the part before it."""
        for spec in specs:
            spec.skip_special_tokens = False

    def constrain(self, c: pb.Constraint | None) -> pb.Constraint | None:
        """The constraint held only after the thought (a thinking request's), the thought within the budget (with
        a budget, a request without a constraint gets one: any answer); as it is otherwise."""
        if not self.thinks or c is None and self.budget is None:
            return c
        out = pb.Constraint()
        if c is None:
            out.lark = ANY_ANSWER
        else:
            out.CopyFrom(c)
        out.thought.open, out.thought.close = self.markers.open, self.markers.close
        if self.budget is not None:
            out.thought.max_tokens = self.budget
        return out


def plan_reasoning(req, fmt: ReasoningFormat, tool_parser_reads: bool,
                   effort_param: str = "reasoning_effort") -> ReasoningPlan | None:
    """The plan for a validated chat request, or None when the model has no thought channel. `tool_parser_reads`:
    the answer goes on to the native tool parser, which drops special tokens' text itself."""
    thinks = thinking(req, fmt, effort_param)
    if fmt.markers is None:
        return None
    hide = fmt.special if req.skip_special_tokens else {}
    return ReasoningPlan(fmt.markers, thinks, req.include_reasoning, hide, {} if tool_parser_reads else hide,
                         req.thinking_token_budget)

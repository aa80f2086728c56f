"""Structured outputs: the API's constraint forms (OpenAI's response_format, vLLM's guided_* and structured_outputs,
llama-server's grammar) mapped to the one pb.Constraint the workers enforce (docs/structured-outputs.md).

At most one form per request. Each constraint is compiled here too (splitgemma.serving.grammar, cached by
constraint), so a bad schema, regex or grammar is a 400 naming the parameter before any slot is taken.
"""

from __future__ import annotations

import json

from llguidance.gbnf_to_lark import any_to_lark

from splitgemma.serving.grammar import ConstraintError, Grammars
from splitgemma.v1 import serving_pb2 as pb

from .protocol import invalid


def _choice_lark(choices: list[str], param: str) -> str:
    if not choices:
        raise invalid(f"{param} must list at least one choice", param=param, code="invalid_value")
    if any(not c for c in choices):
        raise invalid(f"{param}: a choice must not be empty", param=param, code="invalid_value")
    # JSON string literals are Lark (llguidance) string literals.
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def _grammar_lark(text: str, param: str) -> str:
    """A grammar in Lark (llguidance's dialect) or GBNF (llama.cpp's, told by its `::=`), as Lark."""
    try:
        return any_to_lark(text)
    except Exception as e:  # the converter raises plain exceptions for malformed GBNF
        raise invalid(f"{param} is not a valid GBNF grammar: {e}", param=param, code="invalid_value") from None


def _schema_text(schema, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise invalid(f"{param} is not valid JSON: {e}", param=param, code="invalid_value") from None
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"{param} must be a JSON Schema (an object)", param=param, code="invalid_value")
    return json.dumps(schema)


def _forms(req) -> list[tuple[str, pb.Constraint]]:
    """(parameter, constraint) for every constraint form the request sets."""
    out = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", pb.Constraint(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise invalid("response_format of type json_schema needs json_schema.schema",
                          param="response_format.json_schema.schema", code="missing_required_parameter")
        out.append(("response_format.json_schema.schema",
                    pb.Constraint(json_schema=_schema_text(rf.json_schema.schema_,
                                                           "response_format.json_schema.schema"))))
    if req.guided_json is not None:
        out.append(("guided_json", pb.Constraint(json_schema=_schema_text(req.guided_json, "guided_json"))))
    if req.guided_regex is not None:
        out.append(("guided_regex", pb.Constraint(regex=req.guided_regex)))
    if req.guided_choice is not None:
        out.append(("guided_choice", pb.Constraint(lark=_choice_lark(req.guided_choice, "guided_choice"))))
    if req.guided_grammar is not None:
        out.append(("guided_grammar", pb.Constraint(lark=_grammar_lark(req.guided_grammar, "guided_grammar"))))
    if req.grammar is not None:
        out.append(("grammar", pb.Constraint(lark=_grammar_lark(req.grammar, "grammar"))))
    so = req.structured_outputs
    if so is not None:
        if so.json_ is not None:
            out.append(("structured_outputs.json",
                        pb.Constraint(json_schema=_schema_text(so.json_, "structured_outputs.json"))))
        if so.regex is not None:
            out.append(("structured_outputs.regex", pb.Constraint(regex=so.regex)))
        if so.choice is not None:
            out.append(("structured_outputs.choice",
                        pb.Constraint(lark=_choice_lark(so.choice, "structured_outputs.choice"))))
        if so.grammar is not None:
            out.append(("structured_outputs.grammar",
                        pb.Constraint(lark=_grammar_lark(so.grammar, "structured_outputs.grammar"))))
    return out


def wants_constraint(req) -> bool:
    rf = req.response_format
    return (rf is not None and rf.type != "text") or req.structured_outputs is not None or any(
        getattr(req, f) is not None for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                               "grammar"))


def request_constraint(req, grammars: Grammars) -> pb.Constraint | None:
    """The request's constraint, compiled once to check it, or None; ApiError(400) for a bad one or for more than
    one. Runs in the gateway's offload threads: the first call builds the grammar tokenizer."""
    forms = _forms(req)
    if not forms:
        return None
    if len(forms) > 1:
        names = ", ".join(p for p, _ in forms)
        raise invalid(f"a request takes one output constraint; this one sets {names}", param=forms[1][0],
                      code="invalid_value")
    param, c = forms[0]
    try:
        grammars.check(c)
    except ConstraintError as e:
        raise invalid(f"{param}: {e}", param=param, code="invalid_value") from None
    return c

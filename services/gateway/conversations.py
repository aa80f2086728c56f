"""OpenAI's Conversations API (docs/responses.md, "Conversations"): a conversation's items kept in the gateway; a
Responses request with `conversation` reads them before its input, and adds its input and output items to them
when it completes or stops at its token limit.

  POST   /v1/conversations                        create: {items (at most 20), metadata}
  GET    /v1/conversations/{id}                   the conversation object
  POST   /v1/conversations/{id}                   replace its metadata
  DELETE /v1/conversations/{id}                   forget it
  GET    /v1/conversations/{id}/items             its items (limit, order, after: as a response's input_items)
  POST   /v1/conversations/{id}/items             add items (at most 20)
  GET    /v1/conversations/{id}/items/{item_id}   one item
  DELETE /v1/conversations/{id}/items/{item_id}   remove one item; answers the conversation

Items are the Responses API's input items (checked by responses.input_items: messages, function calls and their
outputs, reasoning), each with an id. The store: conversation_store.py.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from .auth import request_owner
from .conversation_store import Conversation, ConversationStore
from .limits import read_body
from .protocol import ApiError, invalid, parse_json_body
from .responses import check_metadata, input_items, list_page, new_id

MAX_NEW_ITEMS = 20   # OpenAI's: items a create or add request may carry


def add_conversation_endpoints(app: FastAPI, store: ConversationStore, keyed: bool, max_body_bytes: int,
                               body_timeout: float) -> None:
    async def read_json(request: Request) -> dict:
        return parse_json_body(await read_body(request, max_body_bytes, body_timeout))

    def found(request: Request, conversation_id: str) -> Conversation:
        c = store.get(conversation_id, request_owner(request, keyed))
        if c is None:
            raise ApiError(404, f"Conversation with id '{conversation_id[:128]}' not found.",
                           param="conversation_id", code="not_found")
        return c

    def new_items(value) -> list[dict]:
        if value is None:
            return []
        if not isinstance(value, list):
            raise invalid("items must be a list of items", param="items", code="invalid_type")
        if len(value) > MAX_NEW_ITEMS:
            raise invalid(f"at most {MAX_NEW_ITEMS} items may be added at once", param="items",
                          code="invalid_value")
        return input_items(value, "items")

    def item_not_found(item_id: str) -> ApiError:
        return ApiError(404, f"Item with id '{item_id[:128]}' not found.", param="item_id", code="not_found")

    @app.post("/v1/conversations")
    async def create_conversation(request: Request):
        body = await read_json(request)
        metadata = check_metadata(body.get("metadata"))
        items = new_items(body.get("items"))
        return store.create(new_id("conv_"), request_owner(request, keyed), metadata, items).body()

    @app.get("/v1/conversations/{conversation_id}")
    async def get_conversation(request: Request, conversation_id: str):
        return found(request, conversation_id).body()

    @app.post("/v1/conversations/{conversation_id}")
    async def update_conversation(request: Request, conversation_id: str):
        c = found(request, conversation_id)
        body = await read_json(request)
        if "metadata" not in body:
            raise invalid("missing required parameter: 'metadata'", param="metadata",
                          code="missing_required_parameter")
        c.metadata = check_metadata(body["metadata"])
        return c.body()

    @app.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(request: Request, conversation_id: str):
        if not store.delete(conversation_id, request_owner(request, keyed)):
            found(request, conversation_id)  # the 404
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @app.get("/v1/conversations/{conversation_id}/items")
    async def list_items(request: Request, conversation_id: str):
        return list_page(list(found(request, conversation_id).items), request.query_params)

    @app.post("/v1/conversations/{conversation_id}/items")
    async def add_items(request: Request, conversation_id: str):
        c = found(request, conversation_id)
        body = await read_json(request)
        if "items" not in body:
            raise invalid("missing required parameter: 'items'", param="items", code="missing_required_parameter")
        items = new_items(body["items"])
        store.add(c.id, c.owner, items)
        return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                "last_id": items[-1]["id"] if items else None, "has_more": False}

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def get_item(request: Request, conversation_id: str, item_id: str):
        item = next((i for i in found(request, conversation_id).items if i.get("id") == item_id), None)
        if item is None:
            raise item_not_found(item_id)
        return item

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def delete_item(request: Request, conversation_id: str, item_id: str):
        c = found(request, conversation_id)
        if not store.remove_item(c.id, c.owner, item_id):
            raise item_not_found(item_id)
        return c.body()

"""The OpenAI error shape, `{"error": {"message", "type", "param", "code"}}` with `code` = the HTTP status, and the
404 words for a route no server here serves: the same from the engine and the gateway.

`type` follows vLLM's names (the class names of the `openai` SDK's exceptions), so clients that branch on it
behave as they do against vLLM.
"""

from __future__ import annotations

from http import HTTPStatus

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    499: "ClientClosedRequestError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    error_type = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


# OpenAI API routes this server does not implement: a client calling one hears so, not a mistyped URL's 404.
OPENAI_ROUTES_NOT_SERVED = (
    "/v1/embeddings", "/v1/audio", "/v1/images", "/v1/moderations", "/v1/files", "/v1/uploads", "/v1/batches",
    "/v1/fine_tuning", "/v1/vector_stores", "/v1/assistants", "/v1/threads", "/v1/realtime", "/v1/conversations",
    "/v1/evals", "/v1/containers", "/v1/videos",
)
_POOLING = "pooling models (embeddings, classification, scoring, reranking) are not served"
_DEV = "vLLM's development and cluster-control routes are not served"
_LORA_UPDATES = ("LoRA adapters are loaded and unloaded at run time only by an engine started with --enable-lora and "
                 "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true")
# Routes vLLM's server has that this one does not, and why: a client moving from vLLM hears which and why.
VLLM_ROUTES_NOT_SERVED = {
    "/v1/load_lora_adapter": _LORA_UPDATES, "/v1/unload_lora_adapter": _LORA_UPDATES,
    "/sleep": "there is no sleep mode (weights stay loaded)",
    "/wake_up": "there is no sleep mode (weights stay loaded)",
    "/is_sleeping": "there is no sleep mode (weights stay loaded)",
    "/invocations": "SageMaker's /invocations is not served; post to /v1/chat/completions or /v1/completions",
    "/v2/embed": _POOLING, "/pooling": _POOLING, "/classify": _POOLING, "/v1/classify": _POOLING,
    "/score": _POOLING, "/v1/score": _POOLING, "/rerank": _POOLING, "/v1/rerank": _POOLING, "/v2/rerank": _POOLING,
    "/v1/audio/transcriptions": "speech-to-text models are not served",
    "/v1/audio/translations": "speech-to-text models are not served",
    "/v1/chat/completions/batch": "send the conversations as separate /v1/chat/completions requests",
    "/load": "an engine's load is in /metrics (vllm:num_requests_running, vllm:num_requests_waiting)",
    "/tokenizer_info": "the tokenizer's configuration is not published", "/get_tokenizer_info": "the tokenizer's "
    "configuration is not published",
    "/start_profile": "there is no profiler route", "/stop_profile": "there is no profiler route",
    "/reset_prefix_cache": _DEV, "/reset_mm_cache": _DEV, "/collective_rpc": _DEV, "/server_info": _DEV,
    "/scale_elastic_ep": _DEV, "/is_scaling_elastic_ep": _DEV, "/pause": _DEV, "/resume": _DEV, "/is_paused": _DEV,
    "/update_weights": _DEV, "/init_weight_transfer": _DEV,
}
SERVED_SUMMARY = ("this server serves text generation (/v1/completions, /v1/chat/completions, /v1/responses, "
                  "/v1/messages), /v1/models, /tokenize and /detokenize")


def route_not_found(method: str, path: str) -> str:
    """The 404 message for a path no route matches."""
    why = VLLM_ROUTES_NOT_SERVED.get(path.rstrip("/") or "/")
    if why is not None:
        return f"{method} {path}: this server does not serve {path} (a vLLM route): {why}; {SERVED_SUMMARY}"
    if any(path == route or path.startswith(route + "/") for route in OPENAI_ROUTES_NOT_SERVED):
        return f"{method} {path}: this OpenAI API route is not implemented here; {SERVED_SUMMARY}"
    return f"Invalid URL ({method} {path}): {SERVED_SUMMARY}"

"""Server interceptors every gradwire server puts in front of its methods: the token, a deadline rule, and
requests that do not parse.

The first two check a call before its handler reads a byte of the request (a refused stream is never
buffered), and both leave the standard health service open, so that probes and load balancers work
without credentials. An interceptor cannot see a call's context, so each wraps the method's handler and
checks at the top of the call. ``RejectMalformed`` makes a request that is not the method's message an
INVALID_ARGUMENT (grpc itself would answer INTERNAL, "Exception deserializing request").
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import grpc

from gradwire.security import bearer, token_matches

HEALTH_PREFIX = "/grpc.health.v1.Health/"
# Without a deadline grpc reports the time left as ~9.2e18 s (not None); beyond a year means "none".
_NO_DEADLINE_SECONDS = 365 * 24 * 3600.0

Check = Callable[[grpc.ServicerContext], None]  # aborts the call (context.abort raises) or returns


def has_deadline(context: grpc.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining < _NO_DEADLINE_SECONDS


class _Guard(grpc.ServerInterceptor, abc.ABC):
    """Runs ``check`` at the top of every call but the health service's."""

    @abc.abstractmethod
    def check(self, context: grpc.ServicerContext) -> None:
        """Abort the call (``context.abort`` raises) or return to let it through."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        return guarded(handler, self.check)


class RequireDeadline(_Guard):
    """Rejects every call that carries no deadline (INVALID_ARGUMENT): without one, a client that hangs
    can hold a server thread forever."""

    MESSAGE = "every call needs a deadline"

    def check(self, context: grpc.ServicerContext) -> None:
        if not has_deadline(context):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.MESSAGE)


class RequireToken(_Guard):
    """Rejects every call without ``authorization: Bearer <token>`` (UNAUTHENTICATED), compared in
    constant time."""

    MESSAGE = "a valid token is required (coordinator train --token-file / $GRADWIRE_TOKEN)"

    def __init__(self, token: str) -> None:
        self._token = token

    def check(self, context: grpc.ServicerContext) -> None:
        if not token_matches(bearer(context.invocation_metadata()), self._token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, self.MESSAGE)


class _Malformed:
    """What a request that failed to parse becomes, so that the handler can answer for it."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class RejectMalformed(grpc.ServerInterceptor):
    """Requests (or stream messages) that do not parse as the method's message -> INVALID_ARGUMENT."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = details.method.rsplit("/", 1)[-1]

        def safe_parse(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as e:  # noqa: BLE001 - any parse failure is the caller's mistake
                return _Malformed(e)

        def check(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request does not parse: {request.error}"
                )
            return request

        def checked_stream(requests: Any, context: grpc.ServicerContext) -> Any:
            for request in requests:
                if isinstance(request, _Malformed):
                    raise ValueError(
                        f"{method}: a streamed message does not parse: {request.error}"
                    )  # the servicer answers INVALID_ARGUMENT
                yield request

        def wrap(behavior: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                request = checked_stream(request, context) if handler.request_streaming else check(request, context)
                return behavior(request, context)

            return call

        return _rebuild(handler, wrap, request_deserializer=safe_parse)


def guarded(handler: grpc.RpcMethodHandler, check: Check) -> grpc.RpcMethodHandler:
    """``handler`` with ``check(context)`` run before its behaviour, whatever its streaming kind."""

    def wrap(behavior: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            check(context)
            return behavior(request, context)

        return call

    return _rebuild(handler, wrap)


def _rebuild(
    handler: grpc.RpcMethodHandler,
    wrap: Callable[[Callable[[Any, grpc.ServicerContext], Any]], Callable[[Any, grpc.ServicerContext], Any]],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour wrapped (and, if given, another request deserializer), whatever its kind."""
    kinds = {
        (False, False): (grpc.unary_unary_rpc_method_handler, handler.unary_unary),
        (False, True): (grpc.unary_stream_rpc_method_handler, handler.unary_stream),
        (True, False): (grpc.stream_unary_rpc_method_handler, handler.stream_unary),
        (True, True): (grpc.stream_stream_rpc_method_handler, handler.stream_stream),
    }
    make, behavior = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        wrap(behavior),
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )

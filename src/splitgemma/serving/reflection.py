"""gRPC server reflection under both names clients ask for: grpc.reflection.v1alpha (all grpcio-reflection ships)
and grpc.reflection.v1 (what current grpcurl and grpcui ask first; v1alpha only as a fallback, or not at all).

v1 is v1alpha renamed: the same messages, field for field, in package grpc.reflection.v1. So one servicer answers
both: v1 calls are decoded and encoded with v1alpha's message classes (the same bytes on the wire), and v1's file
descriptor (v1alpha's with the package renamed) joins the descriptor pool so that v1 can describe itself too.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


_OLD_PREFIX = "." + reflection_pb2.DESCRIPTOR.package + "."


def _renamed(type_name: str) -> str:
    return ".grpc.reflection.v1." + type_name[len(_OLD_PREFIX):]


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = _V1_FILE, "grpc.reflection.v1"
    fdp.ClearField("options")  # v1alpha's java_package and friends name v1alpha
    messages = list(fdp.message_type)
    while messages:
        m = messages.pop()
        messages.extend(m.nested_type)
        for f in m.field:
            if f.type_name.startswith(_OLD_PREFIX):  # (assigning even "" would mark a scalar as typed)
                f.type_name = _renamed(f.type_name)
    for service in fdp.service:
        for method in service.method:
            method.input_type, method.output_type = _renamed(method.input_type), _renamed(method.output_type)
    pool.Add(fdp)


def enable_server_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Reflection v1 and v1alpha on `server` for `service_names` (both reflection services are listed too)."""
    _add_v1_descriptor(descriptor_pool.Default())
    servicer = reflection.aio.ReflectionServicer([*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME,
                                                                          {"ServerReflectionInfo": v1}),))

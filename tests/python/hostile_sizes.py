"""Requests small on the wire and huge once decoded, sent as raw bytes with stock grpcio: an
OpenSession of N empty autoLoad names (two bytes each), then an ordinary ListHosts on the same
channel. Prints a JSON report: the refusal's code and details, and the hosts listed after.

usage: hostile_sizes.py ADDR CA CERT KEY NAMES
"""

import json
import sys

import grpc

import mtls
from toolsrv.v1 import tools_pb2, tools_pb2_grpc


def varint(n):
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def main():
    addr, ca, cert, key, names = sys.argv[1:6]
    ch = mtls.channel(addr, ca, cert, key)
    # OpenSessionRequest { profile (1): SessionProfile { auto_load (1): "" × names } }
    profile = b"\x0a\x00" * int(names)
    request = b"\x0a" + varint(len(profile)) + profile
    open_session = ch.unary_unary(
        "/toolsrv.v1.Tools/OpenSession",
        request_serializer=lambda raw: raw,
        response_deserializer=lambda raw: raw,
    )
    report = {"sent_bytes": len(request)}
    try:
        open_session(request, timeout=30)
        report["code"] = "OK"
    except grpc.RpcError as e:
        report["code"] = e.code().name
        report["details"] = e.details()
    hosts = tools_pb2_grpc.ToolsStub(ch).ListHosts(tools_pb2.ListHostsRequest(), timeout=30)
    report["hosts_after"] = [h.host_id for h in hosts.hosts]
    print(json.dumps(report))


main()

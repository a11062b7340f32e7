"""A toolsrv client written against proto/ only, with stock grpcio: lists hosts, calls a tool
(approving, through the Approve RPC, every approval request the call waits for when the 8th
argument is `approve`), checks health and lists services through server reflection. Prints one
JSON report."""

import json
import sys

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import mtls

from toolsrv.v1 import common_pb2, tools_pb2, tools_pb2_grpc


def main():
    addr, ca, cert, key, host, tool, args = sys.argv[1:8]
    approve = len(sys.argv) > 8 and sys.argv[8] == "approve"
    report = {}
    with mtls.channel(addr, ca, cert, key) as channel:
        tools = tools_pb2_grpc.ToolsStub(channel)
        hosts = tools.ListHosts(tools_pb2.ListHostsRequest(), timeout=15)
        report["hosts"] = [
            {"id": h.host_id, "online": h.state == tools_pb2.HOST_STATE_ONLINE, "os": h.facts.os}
            for h in hosts.hosts
        ]
        listing = tools.ListTools(tools_pb2.ListToolsRequest(host=host), timeout=15)
        report["tools"] = [t.name for t in listing.tools]
        stdout, stderr, result = b"", b"", None
        report["approvals"] = []
        for event in tools.Call(tools_pb2.CallRequest(host=host, tool=tool, args_json=args), timeout=30):
            kind = event.WhichOneof("event")
            if kind == "output":
                if event.output.stream == common_pb2.OUTPUT_STREAM_STDOUT:
                    stdout += event.output.data
                else:
                    stderr += event.output.data
            elif kind == "approval":
                request = event.approval
                report["approvals"].append(
                    {"tool": request.tool, "bypass_argv": list(request.bypass_argv),
                     "caller_may_decide": request.caller_may_decide}
                )
                if approve and request.caller_may_decide:
                    tools.Approve(
                        tools_pb2.ApproveRequest(id=request.id, approve=True, reason="python"),
                        timeout=15,
                    )
            elif kind == "result":
                result = event.result
        report["stdout"] = stdout.decode()
        report["stderr"] = stderr.decode()
        report["status"] = common_pb2.CallStatus.Name(result.status) if result else None
        report["exit_code"] = result.exit_code if result else None
        report["result"] = json.loads(result.result_json) if result and result.result_json else None

        health = health_pb2_grpc.HealthStub(channel)
        report["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(
            health.Check(health_pb2.HealthCheckRequest(service="toolsrv.v1.Tools"), timeout=15).status
        )
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=15
        )
        report["services"] = sorted(s.name for r in responses for s in r.list_services_response.service)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

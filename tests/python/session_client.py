"""The model's side of toolsrv from a client written against proto/ only, with stock grpcio:
ranks tools (FindTools), opens a session, watches it while tools are loaded and unloaded, calls
a tool as part of it, closes it, and sends two bad requests. Prints one JSON report.

Usage: session_client.py ADDR CA CERT KEY SELECTOR QUERY AUTOLOAD LOAD"""

import json
import sys

import grpc

import mtls

from toolsrv.v1 import common_pb2, tools_pb2, tools_pb2_grpc

TIMEOUT = 30


def state_of(state):
    return {
        "id": state.id,
        "generation": state.generation,
        "max_loaded": state.max_loaded,
        "selected": [h.host_id for h in state.selected],
        "loaded": [
            {
                "name": t.name,
                "tier": t.tier,
                "auto_loaded": t.auto_loaded,
                "prompts": [r.definition.prompt for r in t.resolutions],
                "hosts": list(t.hosts),
            }
            for t in state.tools
        ],
    }


def reaching(watch, generation):
    """The first state the watch sends at `generation` or later (the stream has a deadline)."""
    for state in watch:
        if state.generation >= generation:
            return state_of(state)
    raise RuntimeError(f"the watch ended before generation {generation}")


def code_of(call):
    try:
        call()
    except grpc.RpcError as e:
        return e.code().name
    return "OK"


def main():
    addr, ca, cert, key, selector, query, auto_load, load = sys.argv[1:9]
    report = {}
    with mtls.channel(addr, ca, cert, key) as channel:
        tools = tools_pb2_grpc.ToolsStub(channel)

        found = tools.FindTools(
            tools_pb2.FindToolsRequest(selector=selector, query=query, limit=3), timeout=TIMEOUT
        )
        report["ranker"] = found.ranker
        report["matches"] = [
            {"name": m.name, "score": m.score, "hosts": list(m.hosts)} for m in found.matches
        ]

        profile = tools_pb2.SessionProfile(auto_load=[auto_load], max_loaded=2)
        opened = tools.OpenSession(
            tools_pb2.OpenSessionRequest(profile=profile, hosts=selector), timeout=TIMEOUT
        )
        sid = opened.id
        report["opened"] = state_of(opened)

        watch = tools.WatchSession(tools_pb2.GetSessionRequest(session=sid), timeout=TIMEOUT)
        report["watched"] = [state_of(next(watch))]
        loaded = tools.LoadTool(tools_pb2.LoadToolRequest(session=sid, tool=load), timeout=TIMEOUT)
        report["loaded"] = state_of(loaded)
        report["watched"].append(reaching(watch, loaded.generation))
        unloaded = tools.UnloadTool(
            tools_pb2.UnloadToolRequest(session=sid, tool=auto_load), timeout=TIMEOUT
        )
        report["unloaded"] = state_of(unloaded)
        report["watched"].append(reaching(watch, unloaded.generation))

        result = None
        for event in tools.Call(
            tools_pb2.CallRequest(
                host=opened.selected[0].host_id, tool=load, args_json="{}", session=sid
            ),
            timeout=TIMEOUT,
        ):
            if event.WhichOneof("event") == "result":
                result = event.result
        report["call_status"] = common_pb2.CallStatus.Name(result.status) if result else None

        listed = tools.ListSessions(tools_pb2.ListSessionsRequest(), timeout=TIMEOUT)
        report["listed"] = [s.id == sid for s in listed.sessions]

        tools.CloseSession(tools_pb2.GetSessionRequest(session=sid), timeout=TIMEOUT)
        report["listed_after_close"] = len(
            tools.ListSessions(tools_pb2.ListSessionsRequest(), timeout=TIMEOUT).sessions
        )
        try:
            for _ in watch:
                pass
            report["watch_end"] = "OK"
        except grpc.RpcError as e:
            report["watch_end"] = e.code().name

        report["load_closed"] = code_of(
            lambda: tools.LoadTool(
                tools_pb2.LoadToolRequest(session=sid, tool=load), timeout=TIMEOUT
            )
        )
        report["long_query"] = code_of(
            lambda: tools.FindTools(
                tools_pb2.FindToolsRequest(selector=selector, query="disk " * 1000),
                timeout=TIMEOUT,
            )
        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()

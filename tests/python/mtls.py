"""The mutual-TLS channel both gRPC clients here open to the coordinator."""

import grpc


def channel(addr, ca, cert, key):
    """A channel to `addr` presenting the client certificate `cert` (key `key`) and trusting
    the CA in `ca`, once it is ready (within 15 s)."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=open(ca, "rb").read(),
        private_key=open(key, "rb").read(),
        certificate_chain=open(cert, "rb").read(),
    )
    ch = grpc.secure_channel(addr, creds)
    grpc.channel_ready_future(ch).result(timeout=15)
    return ch

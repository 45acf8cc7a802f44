"""Object storage as the product meets it, on this machine: a real S3-compatible server on loopback
(SeaweedFS) and a latency proxy. They live in the installed package (`app/s3_server.py`, also
`cellfeed s3-server`); tests and benchmarks import them from here or there alike."""

from app.s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Proxy, SeaweedServer

__all__ = ["ACCESS_KEY", "REGION", "SECRET_KEY", "S3Proxy", "SeaweedServer"]

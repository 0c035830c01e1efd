"""What the engine, the gateway and the `lockstep` command share: standard library only.

The gateway and the operator import nothing of `lockstep` or `lockstep_engine` (pyproject.toml's
import-linter contracts); the pieces all of them need live here instead of in copies: the argument
parser (`argparsing`), the OpenAI error shape and the 404 words (`errors`), listening sockets
(`sockets`), and the health listener that answers `/health` off a server's event loop
(`health_listener`, `health_server`, `probe_http`). Nothing here imports anything outside the standard
library, so every image and the bare `lockstep` command can import all of it.
"""

"""gRPC's C core logs to stderr itself, as text, apart from Python's logging: held to its errors here.

At its default verbosity it logs routine events at INFO, such as a GOAWAY whenever a peer restarts with
a stream open (a drafter in a rollout, seen by every verifier): a line no JSON log pipeline can parse
(`--log-format json`, service/logs.py) and noise in a text one. The core reads GRPC_VERBOSITY once, on
a thread of its own, right after `grpc` is first imported, so the default has to be in the environment
before that: this module is imported first by the `drafter_sdk` package (and so by both services and
any drafter built on the SDK). A GRPC_VERBOSITY already set (DEBUG, INFO, NONE) is left as it is.
"""

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

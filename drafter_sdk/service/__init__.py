"""What both splitspec services (the verifier and every drafter) are built on: one gRPC server
lifecycle, TLS and bearer tokens, the /metrics endpoint, logging, gRPC targets resolved to every
replica, the commands' exit."""

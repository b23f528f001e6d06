"""A Drafter served over gRPC: the servicer (deltas in, drafts out), each request's history, the
drafter's metrics, what it learned kept across restarts and taken from peers, and `splitspec-drafter`."""

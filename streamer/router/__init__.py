"""Data parallelism: requests spread over engine replicas by a cache-aware router.

  tree.py           PrefixTree: an approximate picture of what a replica's radix cache holds
  policy.py         RoutingPolicy: session, then longest prefix within a load margin, then least loaded
  keys.py           the routing key of a request: its prompt's text (or token ids)
  data_parallel.py  DataParallelEngine: N EngineProcess replicas behind the Engine interface
  devices.py        which CUDA devices each replica gets
  http.py           `streamer router`: the same policy in front of separate `streamer serve` hosts
"""

"""ADP KV connector: NVMe/TCP host client, KV page store, vLLM adapter."""

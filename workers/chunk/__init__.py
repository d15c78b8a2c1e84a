"""The chunk path: lease a chunk's items, fetch and decode them, batch them through the engine,
write results and a shard, close the job when its last chunk is done."""

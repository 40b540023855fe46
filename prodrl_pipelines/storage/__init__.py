"""Where bytes live: the blob store (a directory or an S3 prefix), atomic local writes, round
documents (JSON and Parquet under a key), checkpoint directories with manifests, the key layout,
and ``StoreLocation``, the one description of a home's stores that every process opens."""

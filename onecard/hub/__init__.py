"""Where a checkpoint comes from: a local directory, the bundled model, or a hub id found in or downloaded into
the Hugging Face cache (resolve.py), and the download itself (download.py). Below config, which resolves --model
through it, and beside models/, which loads what it found."""

"""Generation engines (interface: base.py): in-process batching (inprocess.py); OpenAI-compatible servers (server.py)."""

"""The Hugging Face hub, where the tokenizer, wikitext, a streamed dataset or an --init_from model may come
from: when it cannot be reached, the run uses cached files only, and what is missing fails at once instead of
after huggingface_hub's retries (a minute for a tokenizer)."""

import os
import urllib.error
import urllib.request

from common.errors import without_credentials


def hub_needed(args, data_kind):
    """Whether the data, tokenizer or init_from model may have to come from the Hugging Face hub."""
    tokenizer_from_hub = args.data != "dummy" and not os.path.isdir(args.tokenizer)
    hub_data = data_kind in ("hub", "stream")
    model_from_hub = bool(args.init_from) and not os.path.isdir(args.init_from)
    return tokenizer_from_hub or hub_data or model_from_hub


def use_cache_if_hub_unreachable(args, data_kind):
    """One quick request to the hub, where the run may need it; when it fails, HF_HUB_OFFLINE=1 for this
    process and its children. Before any Hugging Face library is imported: they read it once, at import."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or not hub_needed(args, data_kind):
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=5).close()
    except urllib.error.HTTPError:
        pass  # reachable
    except (OSError, ValueError) as error:
        os.environ["HF_HUB_OFFLINE"] = "1"
        if int(os.environ.get("RANK", 0)) == 0:
            said = f"{endpoint} is unreachable ({getattr(error, 'reason', error)}): using cached files only"
            print(without_credentials(said), flush=True)

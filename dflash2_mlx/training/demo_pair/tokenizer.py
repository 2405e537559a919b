"""The embedded pair's tokenizer: byte-level BPE trained with ``tokenizers``, ChatML template.

Saved in the Hugging Face layout that mlx-lm (``load_tokenizer`` -> transformers'
``PreTrainedTokenizerFast``) loads: ``tokenizer.json``, ``tokenizer_config.json`` (with the chat
template and eos), ``special_tokens_map.json``.

Special tokens take ids 0..3 in this order: ``<|endoftext|>`` (eos, also pad and the document
separator in training), ``<|im_start|>``, ``<|im_end|>`` (the end of a chat turn: generation
stops there too) and ``<|mask|>`` (the DFlash drafter's mask token; never in training text).

Determinism: the BPE trainer counts words in parallel but merges by (count, then pair ids), and
the byte alphabet is fixed up front, so the merges do not depend on hash order or threads; a test
trains twice in separate processes (different hash seeds) and compares the files byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END, MASK)

# ChatML, with tools rendered the way Qwen3.5 / Qwen3.8 templates do: the function signatures in
# the system turn inside <tools></tools>, each assistant tool call as
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> text, and tool results as
# <tool_response> blocks in one user turn (consecutive results share it). Without tools the
# rendering is plain ChatML, exactly what ``chat_ids`` builds for training. ``content`` may be a
# string or a list of OpenAI-style parts ({"type": "text", ...}). mlx-lm infers its ``json_tools``
# parser from the "<tool_call>" and "tool_call.name" in this text, so the server parses the calls.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content %}{%- for part in content %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- "
    "endfor %}"
    "{%- endif %}"
    "{%- endmacro %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- render_content(messages[0]['content']) + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    ' + \'{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + render_content(message['content']) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + render_content(message['content']) }}"
    "{%- if message['role'] == 'assistant' and message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if not loop.first or render_content(message['content']) %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson "
    "}}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048, min_frequency: int = 2):
    """A byte-level BPE ``tokenizers.Tokenizer`` (GPT-2 pre-tokenizer regex, no normaliser)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def save_tokenizer(tok, out_dir: Path, model_max_length: int = 4096) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END, MASK],
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"eos_token": EOS, "pad_token": EOS, "additional_special_tokens": [IM_START, IM_END, MASK]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return out_dir


def special_ids(tok) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def encode_plain(tok, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of raw texts, with special-token strings in the text NOT turned into specials
    (training text is code; ``<|endoftext|>`` inside a file is just characters)."""
    return [list(e.ids) for e in _plain_encoder(tok).encode_batch(list(texts), add_special_tokens=False)]


_PLAIN_CACHE: dict = {}


def _plain_encoder(tok):
    """A copy of ``tok`` without added tokens (cached per tokenizer content)."""
    from tokenizers import Tokenizer

    key = tok.to_str()
    if key not in _PLAIN_CACHE:
        data = json.loads(key)
        data["added_tokens"] = []
        _PLAIN_CACHE.clear()
        _PLAIN_CACHE[key] = Tokenizer.from_str(json.dumps(data))
    return _PLAIN_CACHE[key]


def chat_ids(tok, user: str, assistant: str) -> list[int]:
    """One ChatML exchange as training ids (specials inserted as ids, text encoded plainly),
    exactly what the chat template renders for [user, assistant] with the assistant's turn closed."""
    return chat_ids_batch(tok, [(user, assistant)])[0]


def chat_ids_batch(tok, pairs: Sequence[tuple[str, str]]) -> list[list[int]]:
    ids = special_ids(tok)
    role_user, role_assistant, nl = encode_plain(tok, ["user\n", "assistant\n", "\n"])
    texts = encode_plain(tok, [t for pair in pairs for t in pair])
    out = []
    for i in range(len(pairs)):
        user_ids, answer = texts[2 * i], texts[2 * i + 1]
        out.append(
            [ids[IM_START]]
            + role_user
            + user_ids
            + [ids[IM_END]]
            + nl
            + [ids[IM_START]]
            + role_assistant
            + answer
            + [ids[IM_END]]
            + nl
        )
    return out

"""A pretrained model's own tokenizer: a local ``transformers`` folder or a ``tokenizer.json``, never a hub download.

``--data.init_args.tokenizer path/to/model`` (a folder ``save_pretrained`` wrote, with its ``tokenizer.json`` and
``tokenizer_config.json``) or ``path/to/tokenizer.json`` gives the data the tokenizer a model was trained with; with
``HFCausalLM(pretrained=DIR)`` and no tokenizer given, the folder's own is used. It is read with ``transformers``'
``AutoTokenizer`` from local files only; a name that is not a local path (a hub id such as ``Qwen/Qwen3-0.6B``) is
refused: nothing is downloaded.

A checkpoint carries the tokenizer whole (:meth:`PretrainedTokenizer.spec`: the ``tokenizer.json`` text, the chat
template and the special tokens), so ``predict`` and ``export`` work from the checkpoint alone, without the folder.

Example::

    >>> folder = getfixture("tmp_path")
    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> backend = Tokenizer(models.WordLevel({"<eos>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    >>> backend.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> backend.save(str(folder / "tokenizer.json"))
    >>> tok = load_pretrained_tokenizer(str(folder / "tokenizer.json"), eos_token="<eos>")
    >>> tok.encode("a b a"), tok.eos_id, tok.vocab_size
    ([1, 2, 1], 0, 4)
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from lightning_mtp.data.tokenizers import Tokenizer

KIND = "pretrained"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""What a chat template wraps the tokens a model generates in (``{% generation %}``, read by transformers'
``return_assistant_tokens_mask``)."""


def is_tokenizer_path(value: Optional[str]) -> bool:
    """Whether ``--data.tokenizer`` names a tokenizer file or folder rather than ``"bpe"`` / ``"byte"`` / unset."""
    return value is not None and value not in ("bpe", "byte")


def check_tokenizer_path(value: str) -> None:
    """Refuse a ``--data.tokenizer`` that is neither a local ``transformers`` folder nor a ``tokenizer.json``.

    Raises:
        ValueError: naming the flag; a hub id (``org/name``) is told that nothing is downloaded.
    """
    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise ValueError(f"--data.tokenizer {value!r} is a folder without a tokenizer (no tokenizer.json or "
                             "tokenizer_config.json): give the folder of a model saved with save_pretrained, or its "
                             "tokenizer.json")
        return
    if path.is_file():
        if path.suffix != ".json":
            raise ValueError(f"--data.tokenizer {value!r} is a file but not a tokenizer.json: give a tokenizer.json "
                             "(Hugging Face tokenizers format) or the model folder that holds it")
        return
    hub_like = "/" in value and not value.startswith((".", "/", "~")) and value.count("/") == 1
    why = ("looks like a Hugging Face hub id, and lightning-mtp downloads nothing" if hub_like
           else "is not an existing file or folder")
    raise ValueError(f"--data.tokenizer {value!r} {why}: give 'bpe', 'byte', a local model folder or a "
                     "tokenizer.json (to use a hub model, download it first, e.g. `huggingface-cli download "
                     f"{value if hub_like else 'ORG/NAME'} --local-dir DIR`, and give DIR)")


def load_pretrained_tokenizer(path: str, **special_tokens: str) -> PretrainedTokenizer:
    """The tokenizer of a local model folder (``AutoTokenizer``, local files only) or of a ``tokenizer.json``
    (``special_tokens`` such as ``eos_token="</s>"`` complete a bare ``tokenizer.json``)."""
    check_tokenizer_path(path)
    transformers = _transformers()
    target = Path(path).expanduser()
    if target.name == "tokenizer.json" and (target.parent / "tokenizer_config.json").is_file():
        target = target.parent  # the same file, with the special tokens and settings saved beside it
    try:
        if target.is_dir():
            hf = transformers.AutoTokenizer.from_pretrained(str(target), local_files_only=True)
        else:
            hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(target), **special_tokens)
    except (OSError, ValueError, KeyError, ImportError) as error:  # no tokenizer files, or a slow one to convert
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if target.is_dir() and not (target / "tokenizer.json").is_file():
            reason = f"it has no tokenizer.json, and reading another tokenizer failed: {reason}"
        raise ValueError(f"--data.tokenizer: transformers cannot load a tokenizer from {path!r} (lightning-mtp needs "
                         f"a fast one, a tokenizer.json): {reason}") from error
    if special_tokens and target.is_dir():
        hf.add_special_tokens({k: v for k, v in special_tokens.items() if k in SPECIAL_TOKEN_NAMES})
    if hf.eos_token_id is None and not target.is_dir():
        raise ValueError(f"--data.tokenizer {path}: a tokenizer.json alone names no EOS token (documents are ended "
                         "with it and decoding stops at it): give the folder that holds it with the "
                         "tokenizer_config.json naming eos_token, as tokenizer.save_pretrained(folder) writes them")
    return PretrainedTokenizer(hf, name=target.name if target.is_dir() else target.parent.name or target.stem)


def other_ids(given: PretrainedTokenizer, own: PretrainedTokenizer) -> Optional[str]:
    """How ``given`` maps ``own``'s tokens to other ids, or ``None`` when it maps every one of them as ``own`` does
    (it may add tokens, or differ in its chat template): the first token whose id differs or that it lacks, and how
    many do."""
    mine, theirs = own.hf.get_vocab(), given.hf.get_vocab()
    differ = sorted((index, token) for token, index in mine.items() if theirs.get(token) != index)
    if not differ:
        return None
    index, token = differ[0]
    there = theirs.get(token)
    return (f"{len(differ)} of the model's {len(mine)} tokens differ, the first {token!r}: id {index} in the "
            f"model's tokenizer, " + ("absent from this one" if there is None else f"id {there} in this one"))


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - transformers is installed with the hf/test extras
        raise ValueError("--data.tokenizer: a pretrained tokenizer needs transformers: pip install "
                         "'lightning-mtp[hf]'") from error
    return transformers


ENCODING_SETTINGS = ("split_special_tokens",)
"""``tokenizer_config.json`` settings that change the ids text is encoded to and that ``tokenizer.json`` does not hold
(``split_special_tokens``: "<|im_end|>" written in a text is split into pieces, not the special token)."""


class PretrainedTokenizer(Tokenizer):
    """A ``transformers`` fast tokenizer behind lightning-mtp's :class:`~lightning_mtp.data.tokenizers.Tokenizer`.

    ``encode`` adds no special tokens (text pieces, prompts); :meth:`encode_document` adds the ones the model
    expects around a training document (its BOS, as ``tokenizer(text)`` does) and ends it with EOS, so the model
    learns where text ends. :meth:`render_chat` applies the chat template.
    """

    kind = KIND

    def __init__(self, hf: Any, name: str = "pretrained") -> None:
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"--data.tokenizer: {type(hf).__name__} is a slow tokenizer; lightning-mtp needs a fast "
                             "one (a tokenizer.json): save it with a recent transformers to write one")
        if hf.eos_token_id is None:
            raise ValueError("--data.tokenizer: the tokenizer has no eos_token (documents are ended with it and "
                             "decoding stops at it): set eos_token in its tokenizer_config.json")
        self.hf = hf
        self._json = backend.to_str()
        # settings of tokenizer_config.json that change how text is encoded beyond tokenizer.json (only when set, so
        # the fingerprints and records of tokenizers without them are as they were)
        self.settings = {name: True for name in ENCODING_SETTINGS if getattr(hf, name, False) is True}
        payload = {"json": self._json, "special": self.special_tokens(), **({"settings": self.settings}
                                                                            if self.settings else {})}
        self._fingerprint = hashlib.sha1(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()
        self.name = f"{name}-{len(hf)}"

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_id(self) -> int:
        return int(self.hf.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.hf.pad_token_id
        return int(self.eos_id if pad is None else pad)

    @property
    def bos_id(self) -> Optional[int]:
        return self.hf.bos_token_id

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def chat_template(self) -> Optional[str]:
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) else None

    def special_tokens(self) -> dict[str, Optional[str]]:
        return {name: _token_text(getattr(self.hf, name, None)) for name in SPECIAL_TOKEN_NAMES}

    def encode(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.hf(list(texts), add_special_tokens=False)["input_ids"] if texts else []

    def encode_document(self, texts: Sequence[str]) -> list[list[int]]:
        """Training documents: the model's own special tokens (``tokenizer(text)``), then EOS if not already last."""
        encoded = self.hf(list(texts), add_special_tokens=True)["input_ids"] if texts else []
        return [ids if ids and ids[-1] == self.eos_id else [*ids, self.eos_id] for ids in encoded]

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as training saw the start of a document: the model's leading special tokens, no trailing EOS."""
        ids = self.hf(text, add_special_tokens=True)["input_ids"]
        return ids[:-1] if ids and ids[-1] == self.eos_id else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------- chat
    def marks_generation(self) -> bool:
        """Whether the chat template marks the tokens the model generates (``{% generation %}``)."""
        return self.chat_template is not None and GENERATION_MARK.search(self.chat_template) is not None

    def render_chat(self, messages: list[dict], generation_prompt: bool = False, assistant_mask: bool = False,
                    tools: Optional[list[dict]] = None) -> tuple[list[int], Optional[list[int]]]:
        """Token ids of ``messages`` rendered with the chat template, with the ``tools`` the chat offers (JSON-schema
        function dicts, rendered where the template puts them; ``None``: none), and (``assistant_mask``) 1 on the
        tokens the template marks as generated (``return_assistant_tokens_mask``), 0 elsewhere."""
        if self.chat_template is None:
            raise ValueError("--data.messages_field: chat records need a tokenizer with a chat template; this one has "
                             "none (give the model folder's tokenizer, or add a chat_template to its "
                             "tokenizer_config.json)")
        out = self.hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                          add_generation_prompt=generation_prompt,
                                          return_assistant_tokens_mask=assistant_mask)
        ids = list(out["input_ids"])
        return ids, (list(out["assistant_masks"]) if assistant_mask else None)

    @property
    def end_of_turn_id(self) -> Optional[int]:
        """The special token the chat template ends an answer with (ChatML's ``<|im_end|>``, Llama 3's
        ``<|eot_id|>``), when it is not EOS: what a chat model emits when its turn is over, so decoding a chat prompt
        stops there. Found by rendering a short chat with and without its answer; ``None`` without a template or
        where the answer is not followed by a special token."""
        if not hasattr(self, "_end_of_turn"):
            self._end_of_turn = self._find_end_of_turn()
        return self._end_of_turn

    def _find_end_of_turn(self) -> Optional[int]:
        if self.chat_template is None:
            return None
        question = [{"role": "user", "content": "Hi"}]
        try:
            prompt = self.render_chat(question, generation_prompt=True)[0]
            full = self.render_chat([*question, {"role": "assistant", "content": "Yes"}])[0]
        except Exception:  # noqa: BLE001 - a template that needs other roles or fields: no end of turn known
            return None
        rest = full[len(prompt):] if full[:len(prompt)] == prompt else []
        # the answer's tokens as the template renders them: "Yes" encoded alone may differ (SentencePiece gives
        # '▁Yes' to a word that starts a text, 'Yes' after a newline), so find where the decoded rest first holds it
        answered = next((j for j in range(1, len(rest) + 1)
                         if "Yes" in self.hf.decode(rest[:j], skip_special_tokens=False)), None)
        if answered is None or answered >= len(rest):
            return None
        token = rest[answered]
        special = set(self.hf.all_special_ids) | set(getattr(self.hf, "added_tokens_decoder", {}) or {})
        return int(token) if token in special and token != self.eos_id else None

    def stop_ids(self) -> list[int]:
        """The ids decoding stops at by default: EOS, and the chat template's :attr:`end_of_turn_id`."""
        turn = self.end_of_turn_id
        return [self.eos_id] if turn is None else [self.eos_id, turn]

    # ----------------------------------------------------------------- checkpoints and export
    def _spec_payload(self) -> dict:
        return {"json": self._json, "special": self.special_tokens(), "chat_template": self.chat_template,
                **({"settings": self.settings} if self.settings else {})}

    def save(self, folder: str) -> None:
        """Write the tokenizer's files into ``folder`` (``save_pretrained``), e.g. beside an exported model."""
        self.hf.save_pretrained(folder)


def _token_text(token: Any) -> Optional[str]:
    return None if token is None else str(token)


def pretrained_tokenizer_from_spec(spec: dict) -> PretrainedTokenizer:
    """Rebuild a :class:`PretrainedTokenizer` from :meth:`PretrainedTokenizer.spec` (a checkpoint's record)."""
    from tokenizers import Tokenizer as Backend

    transformers = _transformers()
    special = {k: v for k, v in (spec.get("special") or {}).items() if v is not None}
    settings = {k: v for k, v in (spec.get("settings") or {}).items() if k in ENCODING_SETTINGS}
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Backend.from_str(spec["json"]), **special, **settings)
    if spec.get("chat_template"):
        hf.chat_template = spec["chat_template"]
    name = str(spec.get("name", KIND)).rsplit("-", 1)[0]
    return PretrainedTokenizer(hf, name=name)

"""Chat templates other than the tokenizer's own (`generator.chat_template`): a Jinja file, or one
of SkyRL's template names.

SkyRL names two templates, both Qwen3's ChatML: `qwen3_with_thinking` keeps every assistant turn's
content as it was written, `<think>` block included; `qwen3_without_thinking` drops the thinking of
every assistant turn but the last, which only means something when the whole conversation is
rendered again each turn. Multi-turn episodes here are token-in/token-out (`inflight.chat.turns`):
the tokens of earlier turns are the ones the model sampled, thinking included, and are never
rendered again, so `qwen3_without_thinking` is refused (with why), and `qwen3_with_thinking` is
provided: ChatML, every message's content verbatim, `<|im_start|>assistant\\n` as the generation
prompt (with `enable_thinking=false` among generator.chat_template_kwargs, followed by an empty
`<think>` block, as Qwen3's own template does). It lists no tools: an episode that offers tools
needs a template that renders them (the tokenizer's own, or a file).
"""

from __future__ import annotations

from pathlib import Path

from inflight.chat.turns import ChatTemplateError

QWEN3_WITH_THINKING = (
    "{%- if tools %}{{ raise_exception('the qwen3_with_thinking chat template lists no tools: use the "
    "tokenizer\\'s own template or a template file that renders them') }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)

NAMED_TEMPLATES: dict[str, str] = {"qwen3_with_thinking": QWEN3_WITH_THINKING}
REFUSED_NAMES: dict[str, str] = {
    "qwen3_without_thinking": (
        "drops earlier turns' thinking by rendering the whole conversation again every turn; multi-turn "
        "episodes here are token-in/token-out (the context holds the tokens the model sampled, thinking "
        "included), so it would not do what it says: use qwen3_with_thinking (the context it gives) or "
        "the tokenizer's own template"
    ),
}
SOURCE_KEY, NAME_KEY = "generator.chat_template.source", "generator.chat_template.name_or_path"


def resolve_chat_template(source: str, name_or_path: str | None) -> str | None:
    """The Jinja text `generator.chat_template` asks for: None (the tokenizer's own) when
    `name_or_path` is null, a named template for `source="name"`, a file's text for `source="file"`.
    Raises ChatTemplateError naming the key and what to do."""
    if not name_or_path:
        return None
    if source == "name":
        if name_or_path in NAMED_TEMPLATES:
            return NAMED_TEMPLATES[name_or_path]
        reason = REFUSED_NAMES.get(name_or_path)
        known = ", ".join([*NAMED_TEMPLATES, *REFUSED_NAMES])
        if reason is not None:
            raise ChatTemplateError(f"{NAME_KEY}={name_or_path!r} is not available: it {reason}")
        raise ChatTemplateError(f"{NAME_KEY}={name_or_path!r} is not a chat template name: SkyRL's names are "
                                f"{known} (available: {', '.join(NAMED_TEMPLATES)}); for your own template "
                                f"set {SOURCE_KEY}=file and {NAME_KEY} to a Jinja file")
    if source == "file":
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ChatTemplateError(f"{NAME_KEY}={name_or_path!r}: no such file (with {SOURCE_KEY}=file it "
                                    "names a Jinja chat template file)")
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise ChatTemplateError(f"{NAME_KEY}={name_or_path!r}: the template file is empty")
        return text
    raise ChatTemplateError(f"{SOURCE_KEY}={source!r} must be 'name' or 'file'")

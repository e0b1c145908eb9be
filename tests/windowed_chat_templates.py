"""The real chat templates of the windowed families (as their tokenizer_config.json files ship
them) and the special tokens they use, for tiny test tokenizers
(tests/modeling/test_windowed_chat.py).

Gemma 2 (google/gemma-2-*-it, the same as gemma-7b-it), Gemma 3 (google/gemma-3-*-it: system
text folded into the first user turn, content lists of parts), Mistral 7B Instruct v0.1.
"""

GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
    "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user')"
    " != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/"
    "assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set"
    " role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>'"
    " + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if "
    "add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")

GEMMA3 = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content']"
    " is string -%}\n        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n        {%- set first_user_prefix = messages[0]['content'][0]['text'] + "
    "'\\n\\n' -%}\n    {%- endif -%}\n    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n{%- for message in loop_messages -%}\n    {%- if (message['role'] == 'user') "
    "!= (loop.index0 % 2 == 0) -%}\n        {{ raise_exception(\"Conversation roles must "
    "alternate user/assistant/user/assistant/...\") }}\n    {%- endif -%}\n    {%- if "
    "(message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n    {%- else -%}"
    "\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n    {{ '<start_of_turn>' + "
    "role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n    {%- if message['content']"
    " is string -%}\n        {{ message['content'] | trim }}\n    {%- elif message['content'] is "
    "iterable -%}\n        {%- for item in message['content'] -%}\n            {%- if "
    "item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n            {%- elif"
    " item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n            "
    "{%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n        {{ raise_exception(\"Invalid"
    " content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\\n' }}\n{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n")

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/"
    "assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] '"
    " + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ "
    "message['content'] + eos_token + ' ' }}{% else %}{{ raise_exception('Only user and "
    "assistant roles are supported!') }}{% endif %}{% endfor %}")

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>"]
FAMILIES = {
    "gemma2": dict(template=GEMMA2, specials=GEMMA_SPECIALS, bos="<bos>", eos="<eos>",
                   pad="<pad>"),
    "gemma3": dict(template=GEMMA3, specials=GEMMA_SPECIALS, bos="<bos>", eos="<eos>",
                   pad="<pad>"),
    "mistral": dict(template=MISTRAL, specials=["<unk>", "<s>", "</s>"], bos="<s>", eos="</s>",
                    pad=None),
}
CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "  Hello there!  "}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "What is 7 times 8?"},
                  {"role": "assistant", "content": "56."},
                  {"role": "user", "content": "And 9 times 9?"}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "Name a colour."}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Parts of text."}]}],
     "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "add_generation_prompt": True},  # not alternating: every template refuses
]
TRAINING_TEXT = ("Hello there! What is 7 times 8? 56. And 9 times 9? Answer briefly. Name a "
                 "colour. Parts of text. user model assistant system [INST] [/INST] a b\n") * 4

"""Deprecated: the helpers that lived here are now in `titans_hf.files` (writing files), `titans_hf.outputs` (the
commands' outputs and overwrite policy) and `titans_hf.data.tokenizers` (tokenizer helpers)."""

from titans_hf._deprecation import moved_names

__getattr__ = moved_names(__name__, {
    'DEFAULT_MAX_TEXT_CHARACTERS': 'titans_hf.files',
    'KEPT_NAME_BYTES': 'titans_hf.files',
    'MANIFEST_FORMAT': 'titans_hf.outputs',
    'MANIFEST_NAME': 'titans_hf.outputs',
    'MAX_MANIFEST_BYTES': 'titans_hf.outputs',
    'MAX_TEXT_CHARACTERS_VARIABLE': 'titans_hf.files',
    'atomic_write': 'titans_hf.files',
    'atomic_write_json': 'titans_hf.files',
    'atomic_write_text': 'titans_hf.files',
    'check_can_create': 'titans_hf.outputs',
    'check_folder_output': 'titans_hf.outputs',
    'check_outputs': 'titans_hf.outputs',
    'check_tokenizer_argument': 'titans_hf.data.tokenizers',
    'disk_full_message': 'titans_hf.files',
    'file_sha256': 'titans_hf.files',
    'give_umask_permissions': 'titans_hf.files',
    'hidden_sibling': 'titans_hf.files',
    'json_safe': 'titans_hf.files',
    'max_text_characters': 'titans_hf.files',
    'plain_backend_tokenizer': 'titans_hf.data.tokenizers',
    'prepare_output_dir': 'titans_hf.outputs',
    'read_manifest': 'titans_hf.outputs',
    'record_folder': 'titans_hf.outputs',
    'record_outputs': 'titans_hf.outputs',
    'remove_path': 'titans_hf.files',
    'replace_outputs': 'titans_hf.outputs',
    'replaceable_folder_problem': 'titans_hf.outputs',
    'resolve_pad_token_id': 'titans_hf.data.tokenizers',
    'short_name': 'titans_hf.files',
    'umask': 'titans_hf.files',
    'unrecorded_reason': 'titans_hf.outputs',
    'writing_folder': 'titans_hf.outputs',
})

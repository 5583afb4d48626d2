// Encodes texts with the tokenizers of transformers.js (@lenml/tokenizers, the
// same code as @huggingface/transformers' tokenizers): the reference
// tests/model/tokenizer_variants_test.cpp compares strata's readers with.
// usage: node encode_reference.mjs TOKENIZER.json TOKENIZER_CONFIG.json|- TEXTS.json
// prints [{plain: ids, special: ids with the special tokens the file adds, decoded: text of plain}];
// an entry {messages} instead of a text gives {prompt, chat}: the model's chat
// template rendered by @huggingface/jinja, encoded without added special tokens
// (what transformers' apply_chat_template(tokenize=True) does).
import { TokenizerLoader } from '@lenml/tokenizers';
import { Template } from '@huggingface/jinja';
import { readFileSync } from 'node:fs';

const [tokenizerPath, configPath, textsPath] = process.argv.slice(2);
const tokenizerJSON = JSON.parse(readFileSync(tokenizerPath, 'utf8'));
const tokenizerConfig = configPath === '-' ? {} : JSON.parse(readFileSync(configPath, 'utf8'));
const tokenizer = TokenizerLoader.fromPreTrained({tokenizerJSON, tokenizerConfig});
const texts = JSON.parse(readFileSync(textsPath, 'utf8'));
const out = texts.map((text) => {
  if (typeof text === 'object') { // a chat: what transformers' apply_chat_template(tokenize=True) gives
    const name = (t) => (t && typeof t === 'object' ? t.content : t) ?? '';
    const prompt = new Template(tokenizerConfig.chat_template).render({
      messages: text.messages, add_generation_prompt: true, bos_token: name(tokenizerConfig.bos_token),
      eos_token: name(tokenizerConfig.eos_token), date_string: '26 Jul 2024'});
    return {prompt, chat: tokenizer.encode(prompt, {add_special_tokens: false})};
  }
  const plain = tokenizer.encode(text, {add_special_tokens: false});
  const special = tokenizer.encode(text, {add_special_tokens: true});
  return {plain, special, decoded: plain.length === 0 ? "" : tokenizer.decode(plain, {skip_special_tokens: false, clean_up_tokenization_spaces: false})};
});
process.stdout.write(JSON.stringify(out));

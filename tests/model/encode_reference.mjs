// Encodes texts with the tokenizers of transformers.js (@lenml/tokenizers, the
// same code as @huggingface/transformers' tokenizers): the reference
// tests/model/tokenizer_variants_test.cpp compares strata's readers with.
// usage: node encode_reference.mjs TOKENIZER.json TOKENIZER_CONFIG.json|- TEXTS.json
// prints [{plain: ids, special: ids with the special tokens the file adds, decoded: text of plain}].
import { TokenizerLoader } from '@lenml/tokenizers';
import { readFileSync } from 'node:fs';

const [tokenizerPath, configPath, textsPath] = process.argv.slice(2);
const tokenizerJSON = JSON.parse(readFileSync(tokenizerPath, 'utf8'));
const tokenizerConfig = configPath === '-' ? {} : JSON.parse(readFileSync(configPath, 'utf8'));
const tokenizer = TokenizerLoader.fromPreTrained({tokenizerJSON, tokenizerConfig});
const texts = JSON.parse(readFileSync(textsPath, 'utf8'));
const out = texts.map((text) => {
  const plain = tokenizer.encode(text, {add_special_tokens: false});
  const special = tokenizer.encode(text, {add_special_tokens: true});
  return {plain, special, decoded: plain.length === 0 ? "" : tokenizer.decode(plain, {skip_special_tokens: false, clean_up_tokenization_spaces: false})};
});
process.stdout.write(JSON.stringify(out));

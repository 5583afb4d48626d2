// Drives a strata server with the official `openai` npm client: completions and
// chat, streaming and not. Prints one JSON object with the texts it got.
// usage: node openai_client.mjs BASE_URL PROMPT MAX_TOKENS
import OpenAI from 'openai';

const [baseURL, prompt, maxTokens] = process.argv.slice(2);
const client = new OpenAI({baseURL, apiKey: process.env.STRATA_API_KEY || 'none', maxRetries: 0});
const common = {model: 'builtin:tiny', max_tokens: Number(maxTokens), temperature: 0};

const out = {};
const c = await client.completions.create({...common, prompt});
out.completion = c.choices[0].text;
out.completion_finish = c.choices[0].finish_reason;
out.completion_tokens = c.usage.completion_tokens;

let text = '', finish = null;
for await (const chunk of await client.completions.create({...common, prompt, stream: true})) {
  text += chunk.choices[0]?.text ?? '';
  finish = chunk.choices[0]?.finish_reason ?? finish;
}
out.completion_stream = text;
out.completion_stream_finish = finish;

const messages = [{role: 'user', content: prompt}];
const ch = await client.chat.completions.create({...common, messages});
out.chat = ch.choices[0].message.content;
out.chat_role = ch.choices[0].message.role;

text = '';
for await (const chunk of await client.chat.completions.create({...common, messages, stream: true}))
  text += chunk.choices[0]?.delta?.content ?? '';
out.chat_stream = text;

try {
  await client.completions.create({...common, prompt, max_tokens: 100000});
  out.too_long = 'accepted';
} catch (e) {
  out.too_long = `${e.status} ${e.message}`;
}
out.retrieved = (await client.models.retrieve(common.model)).id;
try {
  await client.models.retrieve('no-such-model');
  out.missing = 'found';
} catch (e) {
  out.missing = `${e.status} ${e.code}`;
}
try {
  await client.completions.create({...common, model: 'no-such-model', prompt});
  out.wrong_model = 'accepted';
} catch (e) {
  out.wrong_model = `${e.status} ${e.code}`;
}
// Fields beyond one plain choice: n, logprobs / top_logprobs, penalties, seed.
const many = await client.completions.create({...common, prompt, n: 2, logprobs: 2, temperature: 1, seed: 5});
out.n_texts = many.choices.map((c) => c.text);
out.n_indices = many.choices.map((c) => c.index);
out.completion_logprobs = many.choices[0].logprobs;
const chatlp = await client.chat.completions.create({...common, messages, logprobs: true, top_logprobs: 3});
out.chat_logprobs = chatlp.choices[0].logprobs.content;
out.chat_text = chatlp.choices[0].message.content;
const pen = {...common, prompt, presence_penalty: 1, frequency_penalty: 1.5, repetition_penalty: 1.3, temperature: 1, seed: 9};
out.penalized = [(await client.completions.create(pen)).choices[0].text, (await client.completions.create(pen)).choices[0].text];
let streamedLp = 0;
for await (const chunk of await client.chat.completions.create({...common, messages, stream: true, logprobs: true}))
  streamedLp += chunk.choices[0]?.logprobs?.content?.length ?? 0;
out.chat_stream_logprobs = streamedLp;
console.log(JSON.stringify(out));

// Structured outputs and forced tool calls through the official `openai` npm
// client, checked by an independent validator (ajv). The model has random
// weights: only constrained decoding makes its replies parse.
// usage: node structured_client.mjs BASE_URL
// Prints one JSON object.
import OpenAI from 'openai';
import {zodResponseFormat} from 'openai/helpers/zod';
import {z} from 'zod';
import Ajv from 'ajv';
import addFormats from 'ajv-formats';

const [baseURL] = process.argv.slice(2);
const client = new OpenAI({baseURL, apiKey: 'none', maxRetries: 0, timeout: 120000});
const ajv = new Ajv({strict: false});
addFormats(ajv); // date and uuid are checked too
const model = 'builtin:tiny';
const out = {};

// Ten schemas of the strict-mode kind agents send.
const schemas = [
  {type: 'object', properties: {answer: {type: 'string', maxLength: 12}}, required: ['answer'], additionalProperties: false},
  {type: 'object', properties: {n: {type: 'integer'}, ok: {type: 'boolean'}}, required: ['n', 'ok'], additionalProperties: false},
  {type: 'object', properties: {color: {enum: ['red', 'green', 'blue']}, hex: {type: 'string', maxLength: 7}},
   required: ['color'], additionalProperties: false},
  {type: 'object', properties: {items: {type: 'array', items: {type: 'integer', minimum: 0, maximum: 9}, minItems: 1, maxItems: 4}},
   required: ['items'], additionalProperties: false},
  {type: 'object', properties: {x: {type: 'number'}, y: {type: ['number', 'null']}}, required: ['x', 'y'], additionalProperties: false},
  {type: 'object', properties: {when: {type: 'string', format: 'date'}, id: {type: 'string', format: 'uuid'}},
   required: ['when', 'id'], additionalProperties: false},
  {type: 'object', properties: {user: {type: 'object', properties: {name: {type: 'string', minLength: 1, maxLength: 6},
   age: {type: 'integer', minimum: 0, maximum: 120}}, required: ['name', 'age'], additionalProperties: false}},
   required: ['user'], additionalProperties: false},
  {type: 'object', properties: {value: {anyOf: [{type: 'integer'}, {type: 'string', maxLength: 5}, {type: 'null'}]}},
   required: ['value'], additionalProperties: false},
  {$defs: {leaf: {type: 'object', properties: {v: {type: 'boolean'}}, required: ['v'], additionalProperties: false}},
   type: 'object', properties: {a: {$ref: '#/$defs/leaf'}, b: {type: 'array', items: {$ref: '#/$defs/leaf'}, maxItems: 2}},
   required: ['a', 'b'], additionalProperties: false},
  {type: 'object', properties: {tag: {const: 'fixed'}, count: {type: 'integer', minimum: 1}, note: {type: 'string', maxLength: 4},
   code: {type: 'string', pattern: '^[A-Z]{2}-\\d{3}(\\.[a-z]+)?$'}},
   required: ['tag', 'count', 'code'], additionalProperties: false},
];

// 100 seeded generations (10 per schema), eight at a time.
const jobs = [];
for (let s = 0; s < schemas.length; ++s)
  for (let k = 0; k < 10; ++k) jobs.push({s, seed: 1000 * s + k});
const results = [];
for (let i = 0; i < jobs.length; i += 8) {
  const batch = jobs.slice(i, i + 8).map(async ({s, seed}) => {
    const r = await client.chat.completions.create({
      model, seed, temperature: 1, max_tokens: 400,
      messages: [{role: 'user', content: `Reply as JSON (${s}).`}],
      response_format: {type: 'json_schema', json_schema: {name: `s${s}`, schema: schemas[s], strict: true}},
    });
    const text = r.choices[0].message.content;
    let valid = false, error = '';
    try {
      valid = ajv.validate(schemas[s], JSON.parse(text));
      if (!valid) error = ajv.errorsText();
    } catch (e) {
      error = String(e);
    }
    return {s, seed, finish: r.choices[0].finish_reason, valid, error, text};
  });
  results.push(...await Promise.all(batch));
}
out.schema_runs = results.length;
out.schema_valid = results.filter(r => r.valid && r.finish === 'stop').length;
out.schema_failures = results.filter(r => !(r.valid && r.finish === 'stop')).slice(0, 5);
out.distinct_texts = new Set(results.map(r => r.text)).size;

// zodResponseFormat and chat.completions.parse.
const Event = z.object({name: z.string().max(10), day: z.enum(['mon', 'tue']), guests: z.array(z.string().max(4)).max(2)});
const parsed = await client.beta.chat.completions.parse({
  model, seed: 3, temperature: 1, max_tokens: 400,
  messages: [{role: 'user', content: 'An event.'}],
  response_format: zodResponseFormat(Event, 'event'),
});
out.zod_parsed = parsed.choices[0].message.parsed;
out.zod_ok = Event.safeParse(out.zod_parsed).success;

// json_object: whatever it writes parses as an object (when it finishes).
const jo = await client.chat.completions.create({
  model, seed: 5, temperature: 0, max_tokens: 60,
  messages: [{role: 'user', content: 'Any JSON.'}], response_format: {type: 'json_object'},
});
out.json_object_finish = jo.choices[0].finish_reason;
out.json_object_text = jo.choices[0].message.content;

// A tool round: required -> tool_calls; the tool's answer -> text; named; streamed.
const tools = [
  // (short: the byte-level test model has a context of 512 tokens)
  {type: 'function', function: {name: 'weather',
    parameters: {type: 'object', properties: {city: {type: 'string', maxLength: 6}, unit: {enum: ['c', 'f']}},
                 required: ['city', 'unit']}}},
  {type: 'function', function: {name: 'time', parameters: {type: 'object', properties: {zone: {type: 'string', maxLength: 4}},
    required: ['zone']}}},
];
const argsValid = (call) => {
  const t = tools.find(t => t.function.name === call.function.name);
  return !!t && ajv.validate(t.function.parameters, JSON.parse(call.function.arguments));
};
const ask = [{role: 'user', content: 'Weather in Oslo?'}];
const required = await client.chat.completions.create({
  model, seed: 11, temperature: 1, max_tokens: 150, messages: ask, tools, tool_choice: 'required', parallel_tool_calls: false,
});
const rm = required.choices[0].message;
out.required_finish = required.choices[0].finish_reason;
out.required_calls = (rm.tool_calls ?? []).map(c => ({name: c.function.name, arguments: c.function.arguments, valid: argsValid(c)}));
out.required_content = rm.content;
const named = await client.chat.completions.create({
  model, seed: 12, temperature: 1, max_tokens: 150, messages: ask, tools,
  tool_choice: {type: 'function', function: {name: 'time'}},
});
out.named_calls = (named.choices[0].message.tool_calls ?? []).map(c => ({name: c.function.name, valid: argsValid(c)}));
// Streamed: deltas assembled as agent frameworks assemble them.
const acc = {};
let streamFinish = null;
for await (const chunk of await client.chat.completions.create({
  model, seed: 11, temperature: 1, max_tokens: 150, messages: ask, tools, tool_choice: 'required',
  parallel_tool_calls: false, stream: true,
})) {
  const d = chunk.choices[0]?.delta;
  streamFinish = chunk.choices[0]?.finish_reason ?? streamFinish;
  for (const tc of d?.tool_calls ?? []) {
    acc[tc.index] ??= {name: '', arguments: ''};
    if (tc.function?.name) acc[tc.index].name += tc.function.name;
    if (tc.function?.arguments) acc[tc.index].arguments += tc.function.arguments;
  }
}
out.stream_calls = Object.values(acc);
out.stream_finish = streamFinish;
// The round goes on: the call, its result, and the model's answer (free text).
const call = rm.tool_calls?.[0];
if (call) {
  const answer = await client.chat.completions.create({
    model, seed: 13, temperature: 0, max_tokens: 8, tools,
    messages: [...ask, rm, {role: 'tool', tool_call_id: call.id, content: '-3 C'}],
  });
  out.answer_finish = answer.choices[0].finish_reason;
  out.answer_is_text = typeof answer.choices[0].message.content === 'string';
}
// A schema the server cannot honour: a 400 naming the keyword.
try {
  await client.chat.completions.create({
    model, max_tokens: 5, messages: ask,
    response_format: {type: 'json_schema', json_schema: {name: 'p', schema: {type: 'number', multipleOf: 3}}},
  });
  out.bad_schema = 'accepted';
} catch (e) {
  out.bad_schema = `${e.status} ${e.param ?? ''} ${e.message}`;
}
console.log(JSON.stringify(out));

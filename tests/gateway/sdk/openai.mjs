// The official `openai` npm client against `keel gateway`: chat completions (plain, streamed,
// tools, stop, max_tokens, structured output) through every upstream format, embeddings, models
// and the SDK's error classes. Run by run.sh.
import OpenAI from 'openai';
import { env, models, upstreamModels, REPLY, check, finish, rejectsWith, lastUpstreamRequest, assert } from './lib.mjs';

const client = new OpenAI({ apiKey: env.key, baseURL: `${env.gateway}/v1`, maxRetries: 0, timeout: 20000 });
const say = [{ role: 'user', content: 'say hello' }];
const weatherTool = {
  type: 'function',
  function: { name: 'get_weather', description: 'weather', parameters: { type: 'object', properties: { city: { type: 'string' } } } },
};

for (const model of upstreamModels) {
  await check(`chat.completions.create via ${model}`, async () => {
    const r = await client.chat.completions.create({ model, messages: say });
    assert.equal(r.object, 'chat.completion');
    assert.equal(r.model, model);
    assert.equal(r.choices.length, 1);
    assert.equal(r.choices[0].message.role, 'assistant');
    assert.equal(r.choices[0].message.content, REPLY);
    assert.equal(r.choices[0].finish_reason, 'stop');
    assert.ok(r.usage.prompt_tokens > 0 && r.usage.completion_tokens > 0, JSON.stringify(r.usage));
    assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
  });

  await check(`chat.completions.create stream via ${model}`, async () => {
    const stream = await client.chat.completions.create({
      model, messages: say, stream: true, stream_options: { include_usage: true },
    });
    let text = '';
    let finish = null;
    let usage = null;
    let chunks = 0;
    for await (const chunk of stream) {
      chunks += 1;
      assert.equal(chunk.object, 'chat.completion.chunk');
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices) {
        text += c.delta.content ?? '';
        if (c.finish_reason) finish = c.finish_reason;
      }
    }
    assert.equal(text, REPLY);
    assert.equal(finish, 'stop');
    assert.ok(chunks > 3, `only ${chunks} chunks: not streamed`);
    assert.ok(usage && usage.completion_tokens > 0, 'no usage chunk with include_usage');
  });
}

for (const model of [models.openaiTools, models.anthropicTools, models.geminiTools]) {
  await check(`tools via ${model}`, async () => {
    const r = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'weather in Paris?' }], tools: [weatherTool] });
    const choice = r.choices[0];
    assert.equal(choice.finish_reason, 'tool_calls');
    assert.equal(choice.message.tool_calls.length, 1);
    const call = choice.message.tool_calls[0];
    assert.equal(call.type, 'function');
    assert.equal(call.function.name, 'get_weather');
    assert.deepEqual(JSON.parse(call.function.arguments), { x: 1 });
    assert.ok(call.id, 'tool call without an id');
    // The tool's result goes back; the model answers with text.
    const after = await client.chat.completions.create({
      model, tools: [weatherTool],
      messages: [{ role: 'user', content: 'weather in Paris?' }, choice.message, { role: 'tool', tool_call_id: call.id, content: 'sunny' }],
    });
    assert.equal(after.choices[0].finish_reason, 'stop');
    assert.equal(typeof after.choices[0].message.content, 'string');
  });

  await check(`tools stream via ${model}`, async () => {
    const runner = client.chat.completions.stream({ model, messages: [{ role: 'user', content: 'weather?' }], tools: [weatherTool] });
    const final = await runner.finalChatCompletion();
    const call = final.choices[0].message.tool_calls[0];
    assert.equal(call.function.name, 'get_weather');
    assert.deepEqual(JSON.parse(call.function.arguments), { x: 1 });
    assert.equal(final.choices[0].finish_reason, 'tool_calls');
  });
}

await check('stop and max_tokens', async () => {
  const stopped = await client.chat.completions.create({ model: models.openai, messages: say, stop: ['w3'] });
  assert.equal(stopped.choices[0].message.content, 'say hello w2 ');
  assert.equal(stopped.choices[0].finish_reason, 'stop');
  const cut = await client.chat.completions.create({ model: models.anthropic, messages: say, max_tokens: 3 });
  assert.equal(cut.choices[0].message.content, 'say hello w2');
  assert.equal(cut.choices[0].finish_reason, 'length');
});

await check('sampling parameters reach the OpenAI upstream', async () => {
  await client.chat.completions.create({
    model: models.openai, messages: say, temperature: 0.5, top_p: 0.9, presence_penalty: 0.5, frequency_penalty: 0.25,
    seed: 7, logit_bias: { 50256: -100 }, tools: [weatherTool], parallel_tool_calls: false,
  });
  const sent = (await lastUpstreamRequest('openai')).json;
  assert.equal(sent.presence_penalty, 0.5);
  assert.equal(sent.frequency_penalty, 0.25);
  assert.equal(sent.seed, 7);
  assert.deepEqual(sent.logit_bias, { 50256: -100 });
  assert.equal(sent.parallel_tool_calls, false);
});

const person = {
  type: 'object',
  properties: { name: { type: 'string' }, age: { type: 'integer' }, tags: { type: 'array', items: { type: 'string' } } },
  required: ['name', 'age', 'tags'],
  additionalProperties: false,
};
for (const model of [models.openai, models.anthropic, models.gemini]) {
  await check(`response_format json_schema via ${model}`, async () => {
    const r = await client.chat.completions.create({
      model, messages: say, response_format: { type: 'json_schema', json_schema: { name: 'person', strict: true, schema: person } },
    });
    assert.deepEqual(JSON.parse(r.choices[0].message.content), { name: 'say', age: 1, tags: ['hello'] });
  });
}

await check('embeddings.create (the SDK asks for base64 and decodes it)', async () => {
  const r = await client.embeddings.create({ model: models.embeddings, input: ['alpha', 'beta', 'alpha'] });
  assert.equal(r.object, 'list');
  assert.equal(r.data.length, 3);
  for (const [i, d] of r.data.entries()) {
    assert.equal(d.index, i);
    assert.equal(d.embedding.length, 8);
    assert.ok(d.embedding.every((x) => typeof x === 'number' && Number.isFinite(x)));
  }
  assert.deepEqual(r.data[0].embedding, r.data[2].embedding);
  assert.notDeepEqual(r.data[0].embedding, r.data[1].embedding);
  const norm = r.data[0].embedding.reduce((s, x) => s + x * x, 0);
  assert.ok(Math.abs(norm - 1) < 1e-4, `not a unit vector: |v|^2 = ${norm}`);
  assert.ok(r.usage.prompt_tokens > 0);
  const floats = await client.embeddings.create({ model: models.embeddings, input: 'alpha', encoding_format: 'float' });
  assert.deepEqual(floats.data[0].embedding.map((x) => Math.fround(x)), r.data[0].embedding.map((x) => Math.fround(x)));
});

await check('models.list', async () => {
  const ids = [];
  for await (const m of client.models.list()) {
    assert.equal(m.object, 'model');
    ids.push(m.id);
  }
  for (const model of upstreamModels) assert.ok(ids.includes(model), `${model} not in ${ids.join(', ')}`);
});

await check('error classes: AuthenticationError, NotFoundError, BadRequestError', async () => {
  const bad = new OpenAI({ apiKey: 'sk-keel-not-a-key', baseURL: `${env.gateway}/v1`, maxRetries: 0 });
  const auth = await rejectsWith(bad.chat.completions.create({ model: models.openai, messages: say }), OpenAI.AuthenticationError, 401);
  assert.ok(auth.error && auth.error.message, 'no error body in OpenAI format');
  await rejectsWith(client.chat.completions.create({ model: 'no-such-model', messages: say }), OpenAI.NotFoundError, 404);
  await rejectsWith(client.chat.completions.create({ model: models.openai, messages: [] }), OpenAI.BadRequestError, 400);
  await rejectsWith(client.chat.completions.create({ model: models.openai, messages: say, n: 2 }), OpenAI.BadRequestError, 400);
  // The stream's error arrives before the stream: the SDK raises it from create().
  await rejectsWith(client.chat.completions.create({ model: 'no-such-model', messages: say, stream: true }), OpenAI.NotFoundError, 404);
});

finish('openai');

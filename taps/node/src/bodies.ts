/**
 * Which texts of an OpenAI-compatible exchange the tap reads (docs/tap-protocol.md, "What is
 * read"): chat completions (content strings and parts, tool calls and their results, reasoning,
 * refusals, several choices), completions, the Responses API, and each one streamed.
 */

import type { Exchange } from "./record.js";

type Json = Record<string, unknown>;

const FINAL_EVENTS = new Set(["response.completed", "response.incomplete", "response.failed"]);

function isObject(value: unknown): value is Json {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

function strings(...values: unknown[]): string[] {
  return values.filter((v): v is string => typeof v === "string" && v.length > 0);
}

function integer(value: unknown): number | null {
  return typeof value === "number" && Number.isInteger(value) ? value : null;
}

/** Return the texts of a `content` (or `output`): a string, or each part's `text` or refusal's `refusal`. */
export function contentTexts(content: unknown): string[] {
  if (typeof content === "string") return strings(content);
  if (!Array.isArray(content)) return [];
  const found: string[] = [];
  for (const part of content) {
    if (!isObject(part)) continue;
    if (typeof part.text === "string") found.push(...strings(part.text));
    else if (part.type === "refusal") found.push(...strings(part.refusal));
  }
  return found;
}

/** Return the texts of a chat message, or of a Responses API input or output item. */
export function itemTexts(item: unknown): string[] {
  if (!isObject(item)) return [];
  const kind = item.type;
  if (kind === "function_call") return strings(item.arguments);
  if (kind === "function_call_output") return contentTexts(item.output);
  if (kind === "reasoning") return [...contentTexts(item.content), ...contentTexts(item.summary)];
  if (kind !== undefined && kind !== null && kind !== "message") return [];
  const reasoning = typeof item.reasoning_content === "string" && item.reasoning_content ? item.reasoning_content : item.reasoning;
  const texts = [...strings(reasoning), ...contentTexts(item.content), ...strings(item.refusal)];
  for (const call of Array.isArray(item.tool_calls) ? item.tool_calls : []) {
    const fn = isObject(call) ? call.function : undefined;
    if (isObject(fn)) texts.push(...strings(fn.arguments));
  }
  const legacy = item.function_call;
  if (isObject(legacy)) texts.push(...strings(legacy.arguments));
  return texts;
}

/** Return a request body's texts and message count. */
export function promptTexts(request: unknown): [string[], number] {
  if (!isObject(request)) return [[], 0];
  if (Array.isArray(request.messages)) return [request.messages.flatMap(itemTexts), request.messages.length];
  if ("input" in request || "instructions" in request) {
    const instructions = strings(request.instructions);
    const given = request.input;
    if (Array.isArray(given)) return [[...instructions, ...given.flatMap(itemTexts)], given.length + instructions.length];
    return [[...instructions, ...strings(given)], (typeof given === "string" ? 1 : 0) + instructions.length];
  }
  const prompt = request.prompt;
  const suffix = strings(request.suffix);
  if (typeof prompt === "string") return [[...strings(prompt), ...suffix], 1];
  if (Array.isArray(prompt) && prompt.length) {
    if (typeof prompt[0] === "string" || Array.isArray(prompt[0])) return [[...strings(...prompt), ...suffix], prompt.length];
    return [suffix, 1]; // one prompt of token ids
  }
  return [suffix, 0];
}

/** Return a response body's texts: each choice's message texts and `text`, or each output item's. */
export function answerTexts(response: unknown): string[] {
  if (!isObject(response)) return [];
  if (Array.isArray(response.choices)) {
    return response.choices.flatMap((c) => (isObject(c) ? [...itemTexts(c.message), ...strings(c.text)] : []));
  }
  if (Array.isArray(response.output)) return response.output.flatMap(itemTexts);
  return [];
}

export interface AnswerFacts {
  id: string;
  finishReason: string | null;
  promptTokens: number | null;
  completionTokens: number | null;
  cachedTokens: number | null;
}

/** Return a response body's id, finish reason and usage. */
export function answerFacts(response: unknown): AnswerFacts {
  const none: AnswerFacts = { id: "", finishReason: null, promptTokens: null, completionTokens: null, cachedTokens: null };
  if (!isObject(response)) return none;
  const usage = isObject(response.usage) ? response.usage : {};
  const id = typeof response.id === "string" ? response.id : "";
  if (Array.isArray(response.output) || ("status" in response && !("choices" in response))) {
    const details = usage.input_tokens_details;
    return {
      id,
      finishReason: typeof response.status === "string" ? response.status : null,
      promptTokens: integer(usage.input_tokens),
      completionTokens: integer(usage.output_tokens),
      cachedTokens: isObject(details) ? integer(details.cached_tokens) : null,
    };
  }
  const choices = Array.isArray(response.choices) ? response.choices : [];
  const finish = choices.find((c) => isObject(c) && typeof c.finish_reason === "string") as Json | undefined;
  const details = usage.prompt_tokens_details;
  return {
    id,
    finishReason: finish ? (finish.finish_reason as string) : null,
    promptTokens: integer(usage.prompt_tokens),
    completionTokens: integer(usage.completion_tokens),
    cachedTokens: isObject(details) ? integer(details.cached_tokens) : null,
  };
}

/** Return the response a stream stands for: chat or completions chunks joined, or a Responses stream's. */
export function assembled(events: readonly unknown[]): Json {
  const typed = events.filter(isObject);
  if (typed.some((e) => String(e.type ?? "").startsWith("response."))) return joinedEvents(typed);
  return joinedChunks(typed);
}

interface JoinedChoice {
  message: Record<string, string>;
  calls: Map<number, string>;
  text: string;
  finish: string | null;
}

function joinedChunks(chunks: Json[]): Json {
  const choices = new Map<number, JoinedChoice>();
  let id = "";
  let usage: unknown = null;
  for (const chunk of chunks) {
    if (!id && typeof chunk.id === "string") id = chunk.id;
    if (isObject(chunk.usage)) usage = chunk.usage;
    for (const choice of Array.isArray(chunk.choices) ? chunk.choices : []) {
      if (!isObject(choice)) continue;
      const index = integer(choice.index) ?? 0;
      let joined = choices.get(index);
      if (!joined) {
        joined = { message: {}, calls: new Map(), text: "", finish: null };
        choices.set(index, joined);
      }
      const delta = choice.delta;
      if (isObject(delta)) {
        for (const key of ["reasoning_content", "reasoning", "content", "refusal"]) {
          const piece = delta[key];
          if (typeof piece === "string") joined.message[key] = (joined.message[key] ?? "") + piece;
        }
        const calls = Array.isArray(delta.tool_calls) ? delta.tool_calls : [];
        calls.forEach((call, position) => {
          const fn = isObject(call) ? call.function : undefined;
          if (isObject(fn) && typeof fn.arguments === "string") {
            const at = (isObject(call) ? integer(call.index) : null) ?? position;
            joined.calls.set(at, (joined.calls.get(at) ?? "") + fn.arguments);
          }
        });
        const legacy = delta.function_call;
        if (isObject(legacy) && typeof legacy.arguments === "string") {
          joined.message.function_call_arguments = (joined.message.function_call_arguments ?? "") + legacy.arguments;
        }
      }
      if (typeof choice.text === "string") joined.text += choice.text;
      if (typeof choice.finish_reason === "string") joined.finish = choice.finish_reason;
    }
  }
  const out = [...choices.entries()]
    .sort(([a], [b]) => a - b)
    .map(([index, joined]) => {
      const { function_call_arguments: legacy, ...message } = joined.message;
      const toolCalls = [...joined.calls.entries()].sort(([a], [b]) => a - b).map(([, args]) => ({ function: { arguments: args } }));
      return {
        index,
        message: { ...message, tool_calls: toolCalls, ...(legacy === undefined ? {} : { function_call: { arguments: legacy } }) },
        text: joined.text,
        finish_reason: joined.finish,
      };
    });
  return { id, choices: out, usage };
}

function joinedEvents(events: Json[]): Json {
  const final = events.filter((e) => FINAL_EVENTS.has(String(e.type)) && isObject(e.response));
  if (final.length) return final.at(-1)!.response as Json;
  const created = events.find((e) => isObject(e.response));
  const createdResponse = (created?.response ?? {}) as Json;
  const done = new Map<number, unknown>();
  const deltas = new Map<number, Map<number, string>>();
  for (const event of events) {
    const index = integer(event.output_index);
    if (index === null) continue;
    if (event.type === "response.output_item.done") done.set(index, event.item);
    else if (String(event.type ?? "").endsWith(".delta") && typeof event.delta === "string") {
      const part = integer(event.content_index) || integer(event.summary_index) || 0;
      const parts = deltas.get(index) ?? new Map<number, string>();
      parts.set(part, (parts.get(part) ?? "") + event.delta);
      deltas.set(index, parts);
    }
  }
  const indexes = [...new Set([...done.keys(), ...deltas.keys()])].sort((a, b) => a - b);
  const output = indexes.map((i) =>
    done.has(i)
      ? done.get(i)
      : {
          type: "message",
          content: [...deltas.get(i)!.entries()].sort(([a], [b]) => a - b).map(([, text]) => ({ text })),
        },
  );
  return { id: typeof createdResponse.id === "string" ? createdResponse.id : "", status: createdResponse.status ?? null, output };
}

/** What the gateway knows of an exchange besides its bodies. */
export interface GatewayFacts {
  started?: number;
  caller?: string;
  callerKind?: string;
  key?: string;
  apiBase?: string;
  modelGroup?: string;
  status?: number;
  latencySeconds?: number | null;
  ttftSeconds?: number | null;
}

/** Return the exchange of a request body and its response body, or, streamed, its chunks or events. */
export function exchangeOfBodies(
  request: unknown,
  answer: { response?: unknown; events?: readonly unknown[] },
  facts: GatewayFacts = {},
): Exchange {
  const response = answer.events !== undefined ? assembled(answer.events) : answer.response;
  const [prompt, messages] = promptTexts(request);
  const got = answerFacts(response);
  const model = isObject(request) && typeof request.model === "string" ? request.model : "";
  return {
    upstreamId: got.id,
    started: facts.started ?? 0,
    caller: facts.caller ?? "",
    callerKind: facts.callerKind ?? "unknown",
    key: facts.key ?? "",
    apiBase: facts.apiBase ?? "",
    model,
    modelGroup: facts.modelGroup ?? "",
    stream: answer.events !== undefined,
    status: facts.status ?? 200,
    finishReason: got.finishReason,
    latencySeconds: facts.latencySeconds ?? null,
    ttftSeconds: facts.ttftSeconds ?? null,
    prompt,
    messages,
    response: answerTexts(response),
    promptTokens: got.promptTokens,
    completionTokens: got.completionTokens,
    cachedTokens: got.cachedTokens,
  };
}
